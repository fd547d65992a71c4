"""`build(plan, runtime, weights="load"|"meta")`: what a RunPlan (lstune.train.plan) describes, made — the one
setup `lstune train`, each `lstune bench` trial and `lstune estimate --trace` share.

Steps, in order (each the same for every caller):
1. `load_weights`: the plan's model (RoPE scaling in its config), its 4-bit base and its dtypes (`plan.dtypes`) on
   the runtime's device; or `meta_model`: the same model on the meta device in the same dtypes, with its LoRA
   adapters, for the trace to materialise as fake tensors;
2. the startup self-check on a probe (lstune.train.self_check), unless --skip-self-check (loaded weights only);
3. `Built.prepare`: adapt (device, dtype, LoRA) and apply the techniques in their fixed order (lstune.train.prepare)
   with the plan's resolved memory settings;
4. `make_engine`: the engine the plan's estimate chose (AdamW on one device, or DeepSpeed ZeRO); then, on CUDA, the
   pinned host blocks of every host copy a step makes (`MemoryPlan.reserve_host`), so step 1 is not the slow one;
5. `Built.batches`: each rank's batches, laid out for the model's chunked attention (lstune.parallel.sp_data).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator

from lstune.errors import ConfigError
from lstune.train.plan import RunPlan


@dataclass
class Built:
    """The loaded (`loaded`: LoadedModel, its `model` the prepared one once prepared), prepared (`prepared`:
    PreparedModel) model of a plan, and its engine (None until made; a meta build has none)."""

    plan: RunPlan
    loaded: Any
    prepared: Any = None
    engine: Any = None
    notes: list[str] = field(default_factory=list)  # the engine's line, for the run's report

    @property
    def model(self):
        return self.loaded.model

    def prepare(self, runtime, *, adapted: bool = False) -> Any:
        """Step 3 on the loaded model (`adapted`: device, dtype and LoRA are already done, as `meta_model` does)."""
        from lstune.train.prepare import apply_techniques, prepare_model

        config = self.plan.resolved
        model = self.loaded.model
        self.prepared = apply_techniques(model, config, runtime) if adapted else prepare_model(model, config, runtime)
        self.loaded.model = self.prepared.model
        return self.prepared

    def loss_sum(self, batch: dict, model: Any = None):
        return self.prepared.loss_sum(batch, model)

    def batches(self, dataset, runtime, *, start_sample: int = 0) -> Iterator[dict]:
        """Step 5: every rank reads its own share of one global stream of `dataset`; an SP group then works through
        its ranks' samples one at a time, each sharded along the sequence (ALST 4.2) and laid out for the
        model's chunked attention."""
        from lstune.data.loader import make_dataloader
        from lstune.parallel.sp_data import SPDataAdapter

        config = self.plan.config
        if hasattr(dataset, "rank_batches"):  # --data-streaming (lstune.data.streaming): the same positions
            loader = dataset.rank_batches(config.optim.micro_batch_size, start_sample=start_sample,
                                          rank=runtime.rank, world_size=runtime.world_size)
        else:
            loader = make_dataloader(dataset, config.optim.micro_batch_size, seed=config.optim.seed,
                                     start_sample=start_sample, dp_rank=runtime.rank, dp_size=runtime.world_size)
        chunks = self.prepared.memory.attn_chunking if self.prepared is not None else None
        return iter(SPDataAdapter(loader, runtime.dims, device=runtime.device, chunks=chunks))


def build(plan: RunPlan, runtime, weights: str = "load", *, max_steps: int = 1, tokenizer: Any = None,
          notes: list[str] | None = None, self_check: bool = True) -> Built:
    """The module doc's steps 1-4 for `weights="load"` (`self_check=False`: without step 2, for a bench trial,
    which measures the step and not the startup check); step 1 alone (`meta_model`) for `weights="meta"`, whose
    caller materialises the model and then calls `Built.prepare(runtime, adapted=True)`."""
    if weights == "meta":
        from lstune.models.loading import LoadedModel

        return Built(plan, LoadedModel(meta_model(plan), None, plan.spec.source, list(notes or [])))
    if weights != "load":
        raise ValueError(f"weights must be 'load' or 'meta', not {weights!r}")
    built = Built(plan, load_weights(plan, runtime, tokenizer=tokenizer, notes=notes))
    if self_check:
        _self_check(built, runtime)
    built.prepare(runtime)
    built.engine, note = make_engine(plan, built.model, max_steps, runtime, built.prepared.metp)
    built.notes.append(note)
    # Step 4b: the first step would pin its host copies on the fly, that much slower than the rest (issue 33).
    built.prepared.memory.reserve_host(plan.config.optim.micro_batch_size)
    return built


def load_weights(plan: RunPlan, runtime, *, tokenizer: Any = None, notes: list[str] | None = None,
                 attn_implementation: str | None = None):
    """Step 1: the plan's model loaded onto the runtime's device (lstune.models.loading.load_model)."""
    from lstune.models.loading import load_model

    model = plan.config.model
    dtype, init_device = load_placement(plan, runtime)
    return load_model(
        plan.spec, init=model.init, trust_remote_code=model.trust_remote_code, seed=plan.config.optim.seed,
        tokenizer=tokenizer, notes=notes, load_in_4bit=model.load_in_4bit, device=runtime.device,
        param_dtype=dtype, attn_implementation=attn_implementation, init_device=init_device,
    )


def load_placement(plan: RunPlan, runtime) -> tuple[Any, Any]:
    """(the dtype weights load in, the device random weights are made on) for step 1.

    A LoRA base the run keeps in bf16 (`plan.dtypes.weights`, a 4-bit base aside) loads in bf16 rather than fp32 and
    is cast later anyway (lstune.train.prepare.adapt_model): the same values, half the host memory and time. Random
    weights are made on the CUDA device when one process keeps all of them there (the single-device engine): 8.0 B
    weights took ~120 s on 16 CPU cores (2026-11-28-h100). Several processes still make theirs on the CPU from the
    same seed — identical on every rank by construction, which SP needs."""
    import torch

    dtype = plan.dtypes.torch_param_dtype()
    if plan.dtypes.quantized_rest is None and plan.dtypes.weights == "bf16" and plan.config.model.lora_r:
        dtype = torch.bfloat16
    on_device = (runtime.device.type == "cuda" and plan.engine.kind == "torch" and runtime.world_size == 1
                 and not plan.config.model.load_in_4bit)
    return dtype, (runtime.device if on_device else None)


def meta_model(plan: RunPlan):
    """Step 1 on the meta device: the model in the dtype the run keeps its weights in (`plan.dtypes.weights`),
    with its LoRA adapters — all of it before faking, since `Module.to` (which peft calls to place adapters)
    cannot swap fake parameters."""
    return meta_model_of(plan.resolved, plan.spec.config, bf16=plan.dtypes.weights == "bf16")


def meta_model_of(config, model_config, *, bf16: bool):
    import torch
    from transformers import AutoModelForCausalLM

    from lstune.train.prepare import add_lora

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(model_config, dtype=torch.bfloat16 if bf16 else torch.float32,
                                                 trust_remote_code=config.model.trust_remote_code)
    model.config.use_cache = False
    return add_lora(model, config.model)


def _self_check(built: Built, runtime) -> None:
    """Step 2: the self-check on a probe of the loaded model, noted (lstune.train.self_check)."""
    config = built.plan.resolved
    if config.run.skip_self_check:
        built.loaded.notes.append("self-check skipped (--skip-self-check)")
        return
    from lstune.train.self_check import run_self_check

    built.loaded.notes.append(run_self_check(built.loaded.model, config, runtime).note())


def make_engine(plan: RunPlan, model, max_steps: int, runtime, metp=None):
    """Step 4: the engine the plan's estimate chose (lstune.train.engine_choice): plain AdamW on one device, or
    DeepSpeed ZeRO (with `metp`, a MetpHandle, its shards trained beside it). Returns (engine, the line that says
    which)."""
    from lstune.optim import OptimConfig
    from lstune.train.engine import TorchEngine
    from lstune.train.engine_choice import zero_plan

    config = plan.config
    optim = OptimConfig.from_section(config.optim, max_steps)
    zero = zero_plan(plan.estimate)
    if zero is None:
        if metp is not None:
            raise ConfigError(["--metp-mlp trains its MLP shards beside DeepSpeed's engine; this run has plain AdamW "
                               "(one process): use --gpus N --sp N (N > 1), or drop --metp-mlp."])
        return TorchEngine(model, optim), f"engine: AdamW on {runtime.device}"
    from lstune.parallel.engine_ds import DeepSpeedEngine

    runtime.ensure_process_group()
    local = None
    if metp is not None:  # the shards the model does not register (lstune.parallel.local_params)
        from lstune.parallel.local_params import LocalParams

        local = LocalParams(metp.shard_parameters(), runtime.dims, optim, full_weights=metp.full_weights)
    engine = DeepSpeedEngine(
        model, dims=runtime.dims, optim=optim, zero=zero, bf16=runtime.autocast_dtype is not None,
        trust_checkpoint=config.run.trust_checkpoint, local=local,
    )
    return engine, f"engine: DeepSpeed ZeRO-{zero.stage} ({zero.reason}) on {runtime.world_size} process(es)"
