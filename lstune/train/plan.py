"""`plan(config, cluster, device) -> RunPlan`: a run resolved once, before any weight or data loads.

Every refusal a run makes from the config and the model's config alone, and every `auto` it resolves, live here:

1. the model, resolved once (`ModelSpec`), with --rope-scaling written into its config (lstune.models.rope);
2. the parallel layout: SP × DP for the world and the model's heads (`ParallelDims`, no process groups yet);
3. attention support on the target device, and 4-bit weights only where there are pretrained ones;
4. the estimate (lstune.estimate): the engine (`--zero-stage auto`), the `auto` memory settings (`MemoryChoice`,
   the one memory-settings type: the config's MemorySection resolved), the peaks and the verdict;
5. the dtypes the run keeps its weights and runs its step in.

Every problem of 1-3 (and the engine's own) is reported at once (ConfigError, exit 2). `lstune train`,
`train --dry-run`, `lstune estimate` (--trace too) and every `lstune bench` trial start from a RunPlan, and
`lstune.train.build.build(plan, runtime)` makes what it describes: what one of them shows is what the others run.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, replace
from typing import Any

from lstune.config.schema import TrainConfig
from lstune.errors import ConfigError, UserError


@dataclass(frozen=True)
class Dtypes:
    """The dtypes a run keeps and computes in (lstune.train.prepare.adapt_model, lstune.models.loading)."""

    weights: str  # the frozen base's floating weights: "bf16" (a LoRA base on CUDA, DeepSpeed's bf16) or "fp32"
    trainable: str  # trainable weights (the LoRA adapters, or every weight of a full fine-tune)
    compute: str  # the step's autocast dtype: "bf16" or "fp32"
    quantized_rest: str | None = None  # a 4-bit base's unquantized parts (embeddings, norms, head); None: no 4-bit

    def torch_param_dtype(self):
        """`load_model`'s param_dtype: the 4-bit base's unquantized parts (None: loaded as they are, fp32)."""
        import torch

        return torch.bfloat16 if self.quantized_rest == "bf16" else None

    def to_dict(self) -> dict:
        return {"weights": self.weights, "trainable": self.trainable, "compute": self.compute,
                "quantized_rest": self.quantized_rest}


@dataclass
class RunPlan:
    """A run with every refusal made and every `auto` resolved (module doc)."""

    config: TrainConfig  # as asked (recipe + flags), `auto` unresolved
    spec: Any  # lstune.models.loading.ModelSpec; --rope-scaling already in spec.config
    cluster: Any  # lstune.estimate.hardware.Cluster the plan is for
    device: str  # "cuda" or "cpu": where the step runs
    dims: Any  # lstune.parallel.dims.ParallelDims (SP × DP), groups not built
    estimate: Any  # lstune.estimate.Estimate of the resolved run
    memory: Any  # lstune.estimate.MemoryChoice: the memory settings the run applies, and why
    dtypes: Dtypes
    notes: list[str] = field(default_factory=list)  # RoPE scaling applied, or positions past the model's

    @property
    def resolved(self) -> TrainConfig:
        """The config the run prepares its model with: the memory section as `memory` resolved it."""
        return self.memory.applied_to(self.config)

    @property
    def engine(self):
        return self.estimate.engine

    @property
    def sp(self) -> int:
        return self.dims.sp

    @property
    def fits(self) -> bool:
        return self.estimate.fits

    def verdict(self) -> str:
        return self.estimate.verdict()

    def with_estimate(self, estimate) -> "RunPlan":
        """This plan with another rank's estimate (train takes rank 0's for every rank: one engine, one tiling)."""
        memory = estimate.memory_choice or self.memory
        return replace(self, estimate=estimate, memory=memory)

    def to_dict(self) -> dict:
        """The resolved plan: what `train --dry-run` prints (no `auto` left but the per-batch tile policies)."""
        from lstune.config.parse import format_length

        e = self.estimate
        return {
            "model": f"{self.config.model.name} ({self.spec.source.kind})",
            "seq_len": format_length(self.config.data.seq_len),
            "device": self.device, "processes": self.dims.world_size, "sp": self.dims.sp, "dp": self.dims.dp,
            "ulysses": self.dims.ulysses, "ring": self.dims.ring,
            "engine": e.engine.describe(), "memory": resolved_memory(self),
            "memory_reason": self.memory.reason, "dtypes": self.dtypes.to_dict(), "notes": list(self.notes),
            "device_peak_bytes": e.device_peak_bytes, "device_capacity_bytes": e.device_capacity,
            "host_peak_bytes": e.host_peak_bytes, "host_capacity_bytes": e.host_capacity,
            "fits": e.fits, "verdict": e.verdict(), "hardware": self.cluster.source,
        }


def resolved_recipe(plan: RunPlan) -> dict:
    """The config as the plan resolved it, as flat recipe keys: the memory section, the SP degree, the engine
    (`--zero-stage`, its offloads) and the dtype. `auto` stays only where it names a per-batch policy (Liger's or
    MST's tiles, `resolved_memory` says which); the RoPE factor and --lora-targets are resolved too
    (`_resolve_model_autos`)."""
    view = plan.resolved.to_dict()
    engine = plan.engine
    view.update(sp=plan.sp, zero_stage=str(engine.zero_stage if engine.kind == "deepspeed" else 0),
                dtype=plan.dtypes.compute)
    if engine.kind == "deepspeed":
        view.update(offload_optimizer=engine.offload_optimizer, offload_params=engine.offload_params,
                    offload_ratio=engine.offload_ratio)
    if view.get("init") == "auto":
        view["init"] = "random" if plan.spec.source.kind == "preset" else "pretrained"
    view["attn"] = _attention_backend(plan)
    _resolve_model_autos(view, plan)
    return view


def _resolve_model_autos(view: dict, plan: RunPlan) -> None:
    """The model section's `auto`s as the run resolves them: the RoPE factor written into the model's config, and
    the modules peft adapts for `--lora-targets auto`; settings that do nothing in this run (a RoPE factor without
    --rope-scaling, LoRA options without a rank) are left out rather than shown as `auto`."""
    from lstune.config.schema import LORA_ONLY
    from lstune.models.rope import rope_parameters

    if view.get("rope_scaling") in (None, "none"):
        view.pop("rope_factor", None)
        view.pop("original_max_position_embeddings", None)
    elif view.get("rope_factor") == "auto":
        view["rope_factor"] = float((rope_parameters(plan.spec.config) or {}).get("factor", 1.0))
    if not view.get("lora_r"):
        for key in LORA_ONLY:
            view.pop(key, None)
    elif view.get("lora_targets") == "auto":
        view["lora_targets"] = _auto_lora_targets(plan)


def _auto_lora_targets(plan: RunPlan) -> list[str]:
    """The modules `--lora-targets auto` adapts: peft's own choice on a meta-device build of the plan's model.
    Leaf names (q_proj, …) where they name exactly that set, else the modules' full names."""
    import warnings

    import torch
    from transformers import AutoModelForCausalLM

    from lstune.models.loading import apply_lora

    model_section = plan.config.model
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        model = AutoModelForCausalLM.from_config(copy.deepcopy(plan.spec.config),
                                                 trust_remote_code=model_section.trust_remote_code)
        peft_model = apply_lora(model, r=model_section.lora_r, alpha=None, dropout=0.0, targets="auto")
    names = [name for name, module in peft_model.named_modules() if len(getattr(module, "lora_A", None) or ()) > 0]
    leaves = {name.rsplit(".", 1)[-1] for name in names}
    linears = [name for name, module in peft_model.named_modules() if isinstance(module, torch.nn.Linear)]
    same_leaf_left_out = any(n.rsplit(".", 1)[-1] in leaves and not any(n.startswith(a) for a in names)
                             for n in linears)
    return sorted(names) if same_leaf_left_out else sorted(leaves)


def _attention_backend(plan: RunPlan) -> str:
    """The kernel `--attn auto` picks on the plan's device and dtype (lstune.models.attention.resolve_backend)."""
    import torch

    from lstune.estimate.shapes import text_config
    from lstune.models.attention import resolve_backend

    softcap = getattr(text_config(plan.spec.config), "attn_logit_softcapping", None)
    dtype = torch.bfloat16 if plan.dtypes.compute == "bf16" else torch.float32
    return resolve_backend(plan.config.model.attn, device_type=plan.device, dtype=dtype, softcap=softcap)


def resolved_memory(plan: RunPlan) -> dict:
    """The memory settings with what their remaining `auto` means on this device (a per-batch policy)."""
    m = plan.memory.memory
    loss = m.tiled_loss
    if loss == "auto":
        loss = "MST tiles (vocab/hidden)" if m.mini_sequence else (
            "Liger's fused chunks" if plan.device == "cuda" else "ALST tiles (~1 GiB of logits each)")
    mlp = m.tiled_mlp
    if mlp == "auto":
        mlp = "MST tiles (hidden)" if m.mini_sequence else "ALST tiles (hidden tokens each)"
    return {"tiled_mlp": mlp, "tiled_loss": loss, "mini_sequence": bool(m.mini_sequence),
            "checkpointing": m.checkpointing, "offload_checkpoints": bool(m.offload_checkpoints),
            "attn_chunks": m.attn_chunks, "host_mem_budget": m.host_mem_budget,
            "checkpoint_device_budget": m.checkpoint_device_budget, "recompute_attention": m.recompute_attention}


def plan(config: TrainConfig, cluster, device: str | None = None, *, spec=None, resolve_auto: bool = True,
         world_known: bool = True) -> RunPlan:
    """The RunPlan of `config` on `cluster` (lstune.estimate.hardware.Cluster), training on `device` ("cuda"/"cpu";
    None: the cluster's). `spec`: the model when already resolved (its config gets the RoPE scaling: give a copy you
    own). `resolve_auto=False`: the memory settings as given (a bench ladder rung runs `auto` as the techniques read
    it on their own: ALST's tile counts, no offload). `world_known=False`: a --hostfile run before its launch, whose
    world size the launcher learns: only its SP group is laid out. ConfigError listing every problem."""
    device = device or ("cuda" if cluster.on_cuda else "cpu")
    if config.parallel.metp_mlp:  # METP runs each MLP itself: no MLP tiles (explicit ones are refused with it)
        config = replace(config, memory=replace(config.memory, tiled_mlp="off", mini_sequence=False))
    spec, dims, notes = checked(config, cluster.world_size, device, spec=spec, world_known=world_known,
                                node_size=cluster.gpus)
    estimate = _estimate(config, cluster, spec, resolve_auto)
    memory = estimate.memory_choice or _as_given(config)
    return RunPlan(config, spec, cluster, device, dims, estimate, memory, dtypes_of(config, device, estimate.engine),
                   notes)


def refusals(config: TrainConfig, device: str | None = None) -> list[str]:
    """Every problem `plan` refuses from the config and the model's config alone, for --gpus processes on one node
    (a --hostfile's world is the launcher's to learn), as a list (`device` None: cuda when available); with a
    --resume, then what the ranks would refuse of its checkpoint (`resume_refusals`)."""
    world_known = config.parallel.hostfile is None
    try:
        _, dims, _ = checked(config, config.parallel.gpus, device, world_known=world_known)
    except UserError as exc:
        return exc.problems
    return resume_refusals(config, dims) if world_known else []


def resume_refusals(config: TrainConfig, dims) -> list[str]:
    """What the launched ranks would refuse of a --resume before loading anything (lstune.train.preflight: the
    checkpoint's model, LoRA, ZeRO shards and data order, then its parallel layout against `dims`'), found by the
    launching process with the same functions and messages, before the ranks start (~15 s each). A --resume that
    does not resolve is refused here too, with the ranks' message (lstune.train.outputs); one with nothing to resume
    yet (`auto` before the first checkpoint) passes, as in the ranks."""
    if not config.run.resume:
        return []
    from lstune.train.outputs import resolve_output_dir
    from lstune.train.preflight import check_resume_compatible, check_resume_layout
    from lstune.train.runtime import layout_of

    try:
        _, checkpoint = resolve_output_dir(config.run, config.model.name)
        if checkpoint is None:
            return []
        check_resume_compatible(config, checkpoint, dims.world_size)
        check_resume_layout(checkpoint, layout_of(dims.world_size, dims, config.parallel.metp_mlp,
                                                  config.memory.attn_chunks))
    except UserError as exc:
        return exc.problems
    return []


def checked(config: TrainConfig, world: int, device: str | None, *, spec=None, world_known: bool = True,
            node_size: int | None = None):
    """(spec with the RoPE scaling in its config, the layout, notes): the module doc's checks 1-3, every problem
    reported at once (ConfigError)."""
    from lstune.models.loading import resolve_model

    if spec is None:
        try:
            spec = resolve_model(config.model.name, trust_remote_code=config.model.trust_remote_code)
        except UserError as exc:
            raise ConfigError(exc.problems) from None
    spec = replace(spec, config=copy.deepcopy(spec.config))  # the scaling goes into a config of the plan's own
    problems: list[str] = []
    dims = _collect(problems, _layout, config, world, spec, world_known, node_size or config.parallel.gpus)
    notes = _collect(problems, _positions, config, spec, dims.sp if dims is not None else 1) or []
    _collect(problems, _attention, config, spec, device)
    _collect(problems, _weights, config, spec)
    if problems:
        raise ConfigError(problems)
    return spec, dims, notes


def _collect(problems: list[str], check, *args):
    try:
        return check(*args)
    except UserError as exc:
        problems.extend(exc.problems)
        return None


def _layout(config: TrainConfig, world: int, spec, world_known: bool, node_size: int):
    """SP × DP for the world and the model's heads (ConfigError naming the valid degrees)."""
    from lstune.parallel.dims import ParallelDims

    sp, ring = config.parallel.sp, config.parallel.sp_ring
    if not world_known:  # --hostfile before launch: the SP group alone
        group = sp if isinstance(sp, int) else 1
        return ParallelDims.for_model(group, group, spec.config, ring=ring if group > 1 else 1)
    # Ulysses groups stay inside a node (`node_size` GPUs) under --sp-ring auto.
    return ParallelDims.for_model(world, sp, spec.config, ring=ring, node_size=node_size)


def _positions(config: TrainConfig, spec, sp: int) -> list[str]:
    """--rope-scaling written into the model's config (lstune.models.rope); without it, a warning when --seq-len
    passes the model's positions."""
    from lstune.models.rope import apply_rope_scaling, positions_warning

    model = config.model
    scaling = apply_rope_scaling(
        spec.config, model.rope_scaling, model.rope_factor, seq_len=config.data.seq_len,
        original=model.original_max_position_embeddings, sp=sp, model_name=model.name, pack=config.data.pack,
    )
    if scaling is not None:
        return [scaling.note()]
    warning = positions_warning(spec.config, config.data.seq_len, model.name)
    return [warning] if warning else []


def _attention(config: TrainConfig, spec, device: str | None) -> None:
    from lstune.models.attention_backends import check_attention_support

    check_attention_support(spec.config, pack=config.data.pack, seq_len=config.data.seq_len,
                            backend=config.model.attn, device=device)


def _weights(config: TrainConfig, spec) -> None:
    """load_model quantizes pretrained weights only; a preset (or --init random) has none to quantize."""
    from lstune.models.quant import refuse_random_4bit

    init, source = config.model.init, spec.source
    if config.model.load_in_4bit and (init == "random" or (init == "auto" and source.kind == "preset")):
        refuse_random_4bit(source.name)


def _estimate(config: TrainConfig, cluster, spec, resolve_auto: bool):
    from lstune.estimate import estimate

    return estimate(config, cluster, model_config=spec.config, resolve_auto=resolve_auto)


def _as_given(config: TrainConfig):
    from lstune.estimate import MemoryChoice

    return MemoryChoice(config.memory, "as configured: `auto` as each technique reads it on its own (ALST's tiles, "
                                       "no offload, no mini-sequence)")


def dtypes_of(config: TrainConfig, device: str, engine) -> Dtypes:
    """The dtypes of the run (lstune.estimate.memory.dtypes counts the same): bf16 compute on CUDA unless --dtype
    fp32 (or --dtype bf16 anywhere); a LoRA base on CUDA, and every weight under DeepSpeed's bf16, kept in bf16; a
    4-bit base's unquantized parts in bf16 on CUDA, as the LoRA path casts the whole base to."""
    from lstune.estimate.memory import lora_base_in_bf16

    model, on_cuda = config.model, device == "cuda"
    bf16 = (on_cuda and model.dtype != "fp32") or model.dtype == "bf16"
    zero_bf16 = engine.kind == "deepspeed" and bf16
    weights = "bf16" if lora_base_in_bf16(model.lora_r, model.dtype, on_cuda) or zero_bf16 else "fp32"
    trainable = "bf16" if zero_bf16 else "fp32"
    rest = None
    if model.load_in_4bit:
        rest = "bf16" if on_cuda and model.dtype != "fp32" else "fp32"
    return Dtypes(weights, trainable, "bf16" if bf16 else "fp32", rest)


def local_plan(config: TrainConfig) -> RunPlan:
    """The plan of `config` on this machine for its --gpus processes (what `train --dry-run` shows): this machine's
    CUDA device when there is one, else its CPU."""
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    cluster = machine_cluster(device, config.parallel.gpus)
    return plan(config, cluster, device, world_known=config.parallel.hostfile is None)


def machine_cluster(device: str, processes: int = 1, nodes: int = 1, host_cap: int | None = None):
    """This machine as a Cluster: its CUDA device (or the CPU, each of `processes` local processes with its share of
    the RAM as its "device") × `processes` per node × `nodes`; `host_cap`: the most host memory the run may use
    (a bench trial's --max-host-mem), below the machine's RAM."""
    from lstune.estimate.hardware import CPU, Cluster, local_cuda_device, local_host_bytes

    host = local_host_bytes()
    source = "this machine's CUDA device" if device == "cuda" else "this machine's CPU"
    if host_cap is not None and host_cap < host:
        host, source = host_cap, f"{source}, host memory capped at {host_cap / 2**30:,.1f} GiB"
    if device == "cuda":
        return Cluster(local_cuda_device(), processes, nodes, host, source)
    return Cluster(replace(CPU, device_bytes=host // max(processes, 1)), processes, nodes, host, source)
