"""`lstune estimate --trace`: the real prepared model and real training steps, run on fake tensors, measured.

The model is built on the meta device and materialised as fake tensors (no memory, no data), then prepared
exactly as `lstune train` prepares it (lstune.train.prepare: LoRA, lstune's attention, the memory techniques,
in the target run's dtypes: on a CUDA target the LoRA base is bf16 and the step runs under bf16 autocast), and
one optimizer step runs (forward, backward, AdamW) with Adam's state already present, as in every step after the
first. `LiveBytes` (lstune.memory.measure) follows every storage from the first weight on:
weights, gradients, optimizer state and activations are all counted, and the peak is the step's.

What fake tensors cannot give is supplied as it would be on the real run: lstune's attention finds documents
from the values of `position_ids`, which fake tensors do not have — the spans are computed from the real
positions first (`stated_document_spans`); transformers' packed-batch detection is told the same
(`no_packed_sequence_detection`). Offloaded checkpoints are CPU copies here: they are subtracted from the device
peak and reported as host bytes, in the pinned blocks a CUDA run allocates.

Per-rank modelling: the trace runs one rank's share — the local sequence seq_len / SP, whose Ulysses attention
holds the same bytes (S/SP tokens × all heads before the all-to-all, S tokens × heads/SP after) — with the
single-device engine; for a ZeRO engine the traced weights, gradients and Adam state are replaced by the
analytic per-rank shard of the same state (lstune.estimate.memory), which DeepSpeed's partitioning fixes exactly.
With --metp-mlp the rank is SP rank 0 of its group on the fake process group: METP shards the MLP as in training (its
rank's 1/SP shards, the full weights' storage released), the shards step in the traced AdamW (`_prepare`), and each
layer's rotation runs its point-to-point sends on the fake group (buffers of the real shapes, no data), so the
rotating shards and gradient sums are in the traced peak; under ZeRO the shards' state, which the analytic model
counts outside ZeRO's shares, is replaced like the rest.
Three things differ from the GPU run and are modelled the same way by the analytic estimate the trace is compared
with (`lstune.estimate.traced_settings_estimate`): the loss head runs the ALST tiles (Liger is CUDA-only),
mini-sequence tiles the MLP without fusing its norms (finding them needs a probe on real weights), and attention
runs PyTorch's CPU SDPA kernel (full causal attention holds the same tensors as CUDA's flash kernels; sliding
windows and softcapping do not trace on CPU). A model lstune cannot prepare on CPU is refused with the reason.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from types import SimpleNamespace
from typing import Any

from lstune.config.schema import TrainConfig
from lstune.errors import ConfigError, ModelError


@dataclass
class TraceResult:
    """Measured on fake tensors: per-rank bytes of one steady-state training step."""

    seq_len: int  # local tokens per sample (seq_len / SP)
    layers: int
    device_peak_bytes: int  # the rank's peak, static terms of a ZeRO engine replaced by its shard (module doc)
    traced_peak_bytes: int  # what the single-device trace itself peaked at
    parameter_bytes: int  # weights (and buffers) after preparation
    gradient_bytes: int
    optimizer_bytes: int
    host_peak_bytes: int  # offloaded checkpoints, in CUDA's pinned blocks
    checkpoint_bytes_per_token_layer: int  # the decoder layer input's bytes per token (what a checkpoint holds)
    residual_dtype: str
    loss_backend: str
    seconds: float

    def to_dict(self) -> dict:
        return asdict(self)


def trace_step(config: TrainConfig, *, model_config: Any, target_cuda: bool, sp: int = 1,
               static_bytes: int | None = None, zero3: bool = False) -> TraceResult:
    """Trace one steady-state training step of one rank (module doc). `static_bytes`: the rank's weights + gradients +
    optimizer state when a ZeRO engine shards them (None: the single-device engine's, as traced). `zero3`: the
    target is ZeRO-3, whose partitioned weights take lstune's tiling's `.grad` route (lstune.memory.tiling)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from lstune.models.attention import stated_document_spans
    from lstune.models.hf_internals import no_packed_sequence_detection, traceable_grouped_mm
    from lstune.train.build import meta_model_of

    start = time.perf_counter()
    local = replace(config, data=replace(config.data, seq_len=-(-config.data.seq_len // sp)))
    whole = replace(config, data=replace(config.data, seq_len=local.data.seq_len * sp))
    holder: dict[str, Any] = {}
    live = _meter(exclude=lambda: _host_bytes(holder))
    model = meta_model_of(local, model_config, bf16=_bf16_weights(config, target_cuda, zero=static_bytes is not None))
    # Ulysses' attention sees the whole sequence: its documents are stated for all of it.
    with _sp_group(sp, model_config, config.parallel.sp_ring) as dims, stated_document_spans(_positions(whole)), \
            FakeTensorMode(allow_non_fake_inputs=True):
        runtime = _runtime(config, target_cuda, dims)
        model.to_empty(device="cpu")
        model.tie_weights()  # to_empty gives each module its own copy of a shared weight; tie them again
        base_bytes = _storage_bytes(model)  # allocated before the meter starts; alive throughout
        if zero3:
            _mark_partitioned(model)
        with live, no_packed_sequence_detection(), traceable_grouped_mm():
            prepared, optimizer = _prepare(model, whole, runtime)  # apply_techniques takes its rank's share
            holder["plan"] = prepared.memory
            if prepared.metp is not None:  # METP released the full MLP weights, allocated before the meter started
                base_bytes -= prepared.metp.released_bytes()
            parameter_bytes = base_bytes + live.current
            layer_input = _watch_layer_input(prepared)
            _create_optimizer_state(optimizer)
            live.peak = live.current
            gradient_bytes, optimizer_bytes = _one_step(prepared, optimizer, local, runtime, live)
    live.peak += base_bytes
    traced = live.peak
    if static_bytes is not None:
        # The single-device state alive at the peak (weights, Adam's moments, the gradients backward had made by
        # then) makes way for the ZeRO engine's per-rank state.
        traced_static = parameter_bytes + live.gradients_at_peak + optimizer_bytes
        device_peak = traced - traced_static + static_bytes
    else:
        device_peak = traced
    per_token = layer_input.get("bytes_per_token", 0)
    return TraceResult(
        seq_len=local.data.seq_len, layers=len(prepared.parts.layers), device_peak_bytes=device_peak,
        traced_peak_bytes=traced, parameter_bytes=parameter_bytes, gradient_bytes=gradient_bytes,
        optimizer_bytes=optimizer_bytes,
        host_peak_bytes=_pinned_host_bytes(prepared, local, per_token, layer_input.get("element_size", 2)),
        checkpoint_bytes_per_token_layer=per_token, residual_dtype=layer_input.get("dtype", "?"),
        loss_backend=prepared.memory.loss_backend, seconds=time.perf_counter() - start,
    )


def _runtime(config: TrainConfig, target_cuda: bool, dims=None):
    """One CPU rank standing in for the target's rank: its autocast dtype is the target run's, and so is its AdamW
    (fused on CUDA, as lstune.train.engine.TorchEngine makes it: no per-parameter temporaries); `dims`: its
    sequence-parallel layout (`_sp_group`), None without SP."""
    import torch

    bf16 = (target_cuda and config.model.dtype != "fp32") or config.model.dtype == "bf16"
    return SimpleNamespace(device=torch.device("cpu"), sp=dims.sp if dims else 1, dims=dims,
                           autocast_dtype=torch.bfloat16 if bf16 else None, fused_adamw=True if target_cuda else None)


@contextmanager
def _sp_group(sp: int, model_config, ring: Any = 1):
    """Rank 0 of an SP group of `sp` ranks on torch's `fake` process-group backend, whose collectives return
    buffers of the real shapes and move no data: lstune's Ulysses attention then runs in the trace as on the
    real run, its all-to-all and all-gather buffers included. Yields its ParallelDims (None when sp is 1)."""
    if sp == 1:
        yield None
        return
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from lstune.parallel.dims import ParallelDims

    if dist.is_initialized():
        raise ConfigError([f"--trace at SP {sp} needs a process of its own (torch.distributed is initialised)."])
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=sp)
    try:
        yield ParallelDims.for_model(sp, sp, model_config, ring=ring).build_groups()
    finally:
        dist.destroy_process_group()


def _meter(exclude):
    """`LiveBytes` (torch is imported lazily) that also tells which storages were alive at the peak: each storage
    is numbered as it is allocated, and the peak remembers the number reached."""
    from lstune.memory.measure import LiveBytes

    class PeakMeter(LiveBytes):
        allocations = 0
        peak_allocation = 0

        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self._number: dict[int, int] = {}

        def _track(self, storage) -> None:
            if id(storage) in self._live:
                return
            self.allocations += 1
            self._number[id(storage)] = self.allocations
            before = self.peak
            super()._track(storage)
            if self.peak > before:
                self.peak_allocation = self.allocations

        def alive_at_peak(self, tensors) -> int:
            """Bytes of these (still alive) tensors' storages that existed when the peak was reached."""
            storages = {id(t.untyped_storage()): t.untyped_storage().nbytes() for t in tensors}
            return sum(n for key, n in storages.items() if self._number.get(key, 0) <= self.peak_allocation)

    return PeakMeter(exclude=exclude)


def _positions(config: TrainConfig):
    import torch

    s, b = config.data.seq_len, config.optim.micro_batch_size
    return torch.arange(s).expand(b, s)


def _bf16_weights(config: TrainConfig, target_cuda: bool, *, zero: bool) -> bool:
    """Whether the target keeps its weights in bf16 (lstune.train.plan.dtypes_of): a LoRA base on CUDA, or every
    weight under DeepSpeed's bf16 mode (fp32 master copies live in its optimizer, counted analytically)."""
    from lstune.estimate.memory import Engine
    from lstune.train.plan import dtypes_of

    engine = Engine("deepspeed" if zero else "torch")
    return dtypes_of(config, "cuda" if target_cuda else "cpu", engine).weights == "bf16"


def _mark_partitioned(model) -> None:
    """Mark the trainable weights the way lstune.memory.tiling.is_zero3_partitioned recognises ZeRO-3's, so the
    tiled MLP and loss accumulate weight gradients tile by tile into `.grad` as under ZeRO-3, instead of the
    single-device route's fp32 sums. Nothing else is partitioned: ZeRO's shard is counted analytically."""
    for index, param in enumerate(p for p in model.parameters() if p.requires_grad):
        param.ds_id = index


def _storage_bytes(model) -> int:
    storages = {id(t.untyped_storage()): t.untyped_storage().nbytes()
                for t in [*model.parameters(), *model.buffers()]}
    return sum(storages.values())


def _prepare(model, config: TrainConfig, runtime):
    """lstune's techniques (attention, memory) and the single-device engine's AdamW; LoRA is on already. METP's shards
    (--metp-mlp), which the model does not register, step in the same AdamW: the run trains them with an AdamW of their
    own beside the engine (lstune.parallel.local_params) — the same fp32 gradients and moments."""
    from lstune.optim import OptimConfig, make_adamw
    from lstune.train.prepare import apply_techniques

    prepared = apply_techniques(model, config, runtime)
    params = [p for p in prepared.model.parameters() if p.requires_grad]
    if prepared.metp is not None:
        params += [p for p in prepared.metp.shard_parameters() if p.requires_grad]
    return prepared, make_adamw(params, OptimConfig.from_section(config.optim, 10), fused=runtime.fused_adamw)


def _watch_layer_input(prepared) -> dict:
    """Record the first decoder layer's input (what its checkpoint holds): dtype and bytes per token."""
    seen: dict = {}

    def hook(module, args, kwargs):
        hidden = args[0] if args else kwargs.get("hidden_states")
        if hidden is not None and "dtype" not in seen:
            seen["dtype"] = str(hidden.dtype).removeprefix("torch.")
            seen["bytes_per_token"] = hidden.shape[-1] * hidden.element_size()
            seen["element_size"] = hidden.element_size()

    prepared.parts.layers[0].register_forward_pre_hook(hook, with_kwargs=True)
    return seen


def _create_optimizer_state(optimizer) -> None:
    """Adam's moments exist during every backward but the first: create them with one update from zero
    gradients, so that one traced step is a steady-state step."""
    import torch

    for group in optimizer.param_groups:
        for p in group["params"]:
            p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _one_step(prepared, optimizer, config: TrainConfig, runtime, live) -> tuple[int, int]:
    """Forward, backward and AdamW as lstune.train.step runs them; (gradient bytes, optimizer bytes) at the end.
    `live.gradients_at_peak` is set to the gradient bytes that existed at the step's peak."""
    import torch

    s, b = config.data.seq_len, config.optim.micro_batch_size
    batch = {"input_ids": torch.zeros(b, s, dtype=torch.long), "position_ids": torch.arange(s).expand(b, s),
             "shift_labels": torch.zeros(b, s, dtype=torch.long)}
    dtype = runtime.autocast_dtype
    with torch.autocast("cpu", dtype=dtype or torch.float32, enabled=dtype is not None):
        loss, count = prepared.loss_sum(batch)
    (loss / count).backward()
    params = [p for group in optimizer.param_groups for p in group["params"]]
    grads = [p.grad for p in params if p.grad is not None]
    gradients = sum(g.untyped_storage().nbytes() for g in grads)
    optimizer.step()
    state = sum(t.untyped_storage().nbytes() for st in optimizer.state.values() for t in st.values()
                if isinstance(t, torch.Tensor) and t.dim() > 0)
    live.gradients_at_peak = live.alive_at_peak(grads)
    optimizer.zero_grad(set_to_none=True)
    return gradients, state


def _host_bytes(holder: dict) -> int:
    """Bytes of the host copies alive now: offloaded checkpoints and offloaded attention chunks."""
    plan = holder.get("plan")
    offloader = getattr(plan, "offloader", None)
    chunks = getattr(plan, "attn_chunk_stats", None)
    return ((offloader.stats.host_bytes if offloader is not None else 0)
            + (chunks.host_bytes if chunks is not None else 0))


def _pinned_host_bytes(prepared, config: TrainConfig, per_token: int, element_size: int) -> int:
    """The traced host copies (exact on CPU) counted as a CUDA run holds them, in pinned blocks."""
    from lstune.estimate.memory import pinned_copy_bytes

    offloader, chunks = prepared.memory.offloader, prepared.memory.attn_chunk_stats
    # Offloaded attention chunks (FPDT): their peak as traced; they live during one layer's attention only.
    chunk_bytes = chunks.peak_host_bytes if chunks is not None else 0
    if offloader is None or not per_token:
        return chunk_bytes
    per_layer = config.optim.micro_batch_size * config.data.seq_len * per_token
    return (offloader.stats.peak_host_bytes // per_layer) * pinned_copy_bytes(per_layer, element_size) + chunk_bytes


def trace_estimate(config: TrainConfig, hardware):
    """`lstune estimate --trace`: the plan of `config` for the step the trace runs in `hardware`'s place
    (`Cluster.traced`: the CPU's loss head, no fused norms, chunks read in place, no CUDA context) — every `auto`
    resolved for that step — and the trace of exactly that plan. The estimate it reports is that plan's."""
    from lstune.train.plan import plan

    if config.model.attn not in ("auto", "sdpa"):
        raise ConfigError([f"--trace runs PyTorch's SDPA kernel on CPU; drop --attn {config.model.attn} for the trace."])
    run_plan = plan(config, replace(hardware, traced=True))
    return TraceReport(run_plan.estimate, run_plan.estimate, trace_plan(run_plan))


def trace_plan(run_plan) -> TraceResult:
    """The trace of one rank's step of `run_plan` (its resolved memory settings, its engine, its SP degree)."""
    analytic = run_plan.estimate
    static = None
    if analytic.engine.kind == "deepspeed":
        static = sum(i.device for i in analytic.breakdown.items if i.name.startswith(("param", "grad", "optim")))
    try:
        return trace_step(run_plan.resolved, model_config=run_plan.spec.config, target_cuda=run_plan.cluster.on_cuda,
                          sp=run_plan.sp, static_bytes=static, zero3=analytic.engine.zero_stage == 3)
    except ModelError as exc:
        raise ConfigError([f"--trace runs the step on this CPU, where lstune cannot prepare this model: {exc} "
                           "Drop --trace for the analytic estimate."]) from None
    except (RuntimeError, NotImplementedError) as exc:  # a kernel fake tensors cannot run: a user's way out, no trace
        first = (str(exc).strip().splitlines() or [""])[0]
        raise ConfigError([f"--trace could not run this model's step on fake tensors ({type(exc).__name__}: "
                           f"{first}). Drop --trace for the analytic estimate; --debug shows where it failed."]) \
            from exc


@dataclass
class TraceReport:
    """`lstune estimate --trace`: the analytic estimate, the analytic model of what the trace ran (CPU loss head),
    and the trace."""

    estimate: Any
    comparable: Any  # lstune.estimate.Estimate with the trace's loss head
    trace: TraceResult

    def to_dict(self) -> dict:
        data = self.estimate.to_dict()
        diff = self.comparable.device_peak_bytes - self.trace.device_peak_bytes
        data["trace"] = {**self.trace.to_dict(), "analytic_device_peak_bytes": self.comparable.device_peak_bytes,
                         "analytic_minus_trace_fraction": diff / max(self.trace.device_peak_bytes, 1)}
        return data


# ---- accuracy grid: the analytic model against the trace -------------------------------------------------------

GIB = 2**30
# (name, preset, flat settings). Presets keep their widths; the grid uses 2 layers (every layer is alike, and the
# per-layer terms are what the analytic model has to get right; depth only multiplies checkpoints).
GRID_ARCHS = {
    "llama-3.1-8b": "GQA 32/8, SwiGLU",
    "qwen3-8b": "GQA 32/8, q/k norms",
    "qwen2.5-7b": "GQA 28/4, qkv biases",
    "llama-3.2-1b": "tied embeddings",
    "qwen3-0.6b": "tied embeddings, large vocabulary for its width",
    "phi-3-mini": "MHA, fused qkv and gate_up",
    "mixtral-8x7b": "MoE 8 experts, top-2",
    "qwen3-30b-a3b": "MoE 128 experts, top-8",
}
GRID_SETTINGS = {
    "LoRA defaults": {"lora_r": 16},
    "LoRA + offload": {"lora_r": 16, "offload_checkpoints": True},
    "LoRA + mini-sequence + offload": {"lora_r": 16, "offload_checkpoints": True, "mini_sequence": True},
    "LoRA, MLP untiled": {"lora_r": 16, "tiled_mlp": "off"},
    "full fine-tune": {},
    "LoRA, SP 2 ZeRO-1": {"lora_r": 16, "gpus": 2, "zero_stage": "1"},
    "LoRA, SP 4 ZeRO-3": {"lora_r": 16, "gpus": 4, "zero_stage": "3"},
    "full, SP 4 ZeRO-3": {"gpus": 4, "zero_stage": "3"},
    "LoRA, no checkpointing": {"lora_r": 16, "checkpointing": False},
    "full, no checkpointing": {"checkpointing": False},
    "LoRA, attn chunks 4": {"lora_r": 16, "attn_chunks": 4},
    "LoRA, attn chunks 8": {"lora_r": 16, "attn_chunks": 8},
    "LoRA + offload, attn chunks 4": {"lora_r": 16, "offload_checkpoints": True, "attn_chunks": 4},
    "LoRA + offload, attn chunks 8": {"lora_r": 16, "offload_checkpoints": True, "attn_chunks": 8},
    # Mini-sequence's small loss tiles leave the layer backward as the peak: FPDT's chunk working set sets it
    # (its score tiles the largest part; at 8K, 8 chunks of 1,024 tokens fit one score tile per block, 4 do not).
    "LoRA + mini-sequence, attn chunks 4": {"lora_r": 16, "mini_sequence": True, "attn_chunks": 4},
    "LoRA + mini-sequence, attn chunks 8": {"lora_r": 16, "mini_sequence": True, "attn_chunks": 8},
    "LoRA + mini-sequence + offload, attn chunks 4": {"lora_r": 16, "offload_checkpoints": True, "mini_sequence": True,
                                                      "attn_chunks": 4},
    "full fine-tune, attn chunks 4": {"attn_chunks": 4},
}


def grid_row(arch: str, setting: str, seq_len: int, *, layers: int = 2, gpu: str = "h100-80gb") -> dict:
    """One row of the accuracy grid: analytic and traced device peak of the same rank."""
    from lstune.estimate import estimate, traced_settings_estimate
    from lstune.estimate.hardware import resolve_hardware
    from lstune.models.presets import get_preset, preset_config

    # Attention is chunked only where the setting says so (`auto`, the default, would chunk the longer rows).
    flat = {"model": arch, "seq_len": seq_len, "attn_chunks": "off", **GRID_SETTINGS[setting]}
    config = TrainConfig.from_flat(flat)
    types = get_preset(arch).config.get("layer_types")  # per-layer kinds (gpt-oss: windowed / full): the first ones
    model_config = preset_config(arch, num_hidden_layers=layers, **({"layer_types": types[:layers]} if types else {}))
    hardware = resolve_hardware(gpu=gpu, gpus=config.parallel.gpus, host_mem=1 << 50)
    analytic = estimate(config, hardware, model_config=model_config, suggest=False)
    comparable = traced_settings_estimate(config, hardware, model_config, analytic)
    static = None
    if analytic.engine.kind == "deepspeed":
        static = sum(i.device for i in comparable.breakdown.items if i.name.startswith(("param", "grad", "optim")))
    traced = trace_step(config, model_config=model_config, target_cuda=hardware.on_cuda, sp=analytic.sp,
                        static_bytes=static, zero3=analytic.engine.zero_stage == 3)
    a, t = comparable.device_peak_bytes, traced.device_peak_bytes
    return {"arch": arch, "setting": setting, "seq_len": seq_len, "sp": analytic.sp,
            "engine": analytic.engine.describe(), "analytic": a, "trace": t, "error": (a - t) / t,
            "seconds": traced.seconds}


# The grid of docs/estimate.md: every setting on Llama-3.1-8B shapes at three lengths, and LoRA / full fine-tune
# (and chunked attention) of the other architectures at one.
def default_grid() -> list[tuple[str, str, int]]:
    rows = [("llama-3.1-8b", setting, seq) for setting in GRID_SETTINGS for seq in (8192, 16384, 32768)]
    for arch in ("qwen3-8b", "qwen2.5-7b", "phi-3-mini", "llama-3.2-1b", "qwen3-0.6b"):
        rows += [(arch, "LoRA defaults", 16384), (arch, "full fine-tune", 16384)]
    rows += [(arch, "LoRA defaults", 16384) for arch in ("mixtral-8x7b", "qwen3-30b-a3b")]
    # Chunked attention on MHA with a fused qkv projection (Phi-3) and on GQA 28/4 (Qwen2.5).
    for arch in ("phi-3-mini", "qwen2.5-7b"):
        rows += [(arch, "LoRA, attn chunks 4", 16384), (arch, "LoRA + mini-sequence, attn chunks 4", 16384)]
    return rows


# ---- the estimate against measured GPU peaks -----------------------------------------------------------------

# The rungs of tools/gpu/bench_ladder.py as config settings (LoRA r=16, single-device engine).
BENCH_RUNGS = {
    "tiled_loss": {"tiled_mlp": "off"},
    "tiled_mlp": {},
    "offload": {"offload_checkpoints": True},
    "mini_seq": {"offload_checkpoints": True, "mini_sequence": True},
}


def bench_rows(path: str) -> list[dict]:
    """The analytic estimate beside every successful step of a `bench.json` (docs/benchmarks/*/) whose rung maps to
    a config: torch's `max_memory_allocated` against the estimate without the CUDA context (which it does not
    count); 2-layer rungs carried the other layers' static bytes as ballast, added here as measured."""
    import json

    from lstune.estimate import estimate
    from lstune.estimate.hardware import resolve_hardware
    from lstune.estimate.memory import CUDA_CONTEXT_BYTES
    from lstune.models.presets import preset_config

    records = json.loads(open(path).read())["records"]
    ballast = {r["rung"]: r.get("ballast_bytes", 0) for r in records if r["kind"] == "maxlen"}
    hardware = resolve_hardware(gpu="h100-80gb", host_mem=1 << 50)
    rows = []
    for r in records:
        if r["kind"] != "step" or r["outcome"] != "ok" or r["rung"] not in BENCH_RUNGS:
            continue
        model_config = preset_config(r["preset"], num_hidden_layers=r["layers"])
        rung = BENCH_RUNGS[r["rung"]]
        # The rungs ran ALST's MLP tiles (`auto` then): pinned, since `auto` is now the estimate's choice.
        alst = {"tiled_mlp": -(-r["seq"] // model_config.hidden_size)} if "tiled_mlp" not in rung else {}
        # Nor did they chunk attention (2026-11-23 had none), offload or run mini-sequence unless the rung says so:
        # `auto` would now at their longest lengths, where the margin a fit keeps asks for it. And they re-ran
        # attention in backward (before --recompute-attention, issue 33): pinned too.
        ran = {"attn_chunks": "off", "offload_checkpoints": False, "mini_sequence": False, "recompute_attention": "on",
               **rung}
        config = TrainConfig.from_flat({"model": r["preset"], "seq_len": r["seq"], "lora_r": r["lora_r"],
                                        "zero_stage": "0", **ran, **alst})
        e = estimate(config, hardware, model_config=model_config, suggest=False)
        predicted = e.device_peak_bytes - CUDA_CONTEXT_BYTES + (ballast.get(r["rung"], 0) if r["layers"] < 32 else 0)
        rows.append({"rung": r["rung"], "seq": r["seq"], "layers": r["layers"], "run": 2 if ("fit" in r or "search" in r) else 1,
                     "measured": r["peak_allocated"], "estimate": predicted,
                     "error": (predicted - r["peak_allocated"]) / r["peak_allocated"],
                     "step_s": min(r["step_s"]), "estimate_s": e.step_seconds})
    return rows


def main(argv: list[str] | None = None) -> None:
    """python -m lstune.train.trace [--arch A ...] [--setting S ...] [--seq N ...]: the accuracy grid (analytic vs
    trace, device peak of one rank) as a Markdown table; no arguments: the grid of docs/estimate.md."""
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--arch", nargs="+")
    parser.add_argument("--setting", nargs="+")
    parser.add_argument("--seq", nargs="+", type=int)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--bench", help="instead: the analytic estimate against the peaks of this bench.json")
    args = parser.parse_args(argv)
    if args.bench:
        print("| rung | tokens | layers | run | measured (GiB) | estimate (GiB) | estimate − measured | step (s) | estimate (s) |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
        for r in bench_rows(args.bench):
            print(f"| {r['rung']} | {r['seq']:,} | {r['layers']} | {r['run']} | {r['measured'] / GIB:.2f} | "
                  f"{r['estimate'] / GIB:.2f} | {r['error']:+.1%} | {r['step_s']:.2f} | {r['estimate_s']:.2f} |")
        return
    rows = default_grid()
    if args.arch or args.setting or args.seq:
        rows = [(a, s, n) for a in (args.arch or list(GRID_ARCHS)) for s in (args.setting or list(GRID_SETTINGS))
                for n in (args.seq or [16384])]
    print("| architecture | setting | tokens | SP | engine | analytic (GiB) | trace (GiB) | analytic − trace |")
    print("|---|---|---:|---:|---|---:|---:|---:|")
    for arch, setting, seq in rows:
        r = grid_row(arch, setting, seq, layers=args.layers)
        print(f"| {arch} | {setting} | {seq:,} | {r['sp']} | {r['engine']} | {r['analytic'] / GIB:.2f} | "
              f"{r['trace'] / GIB:.2f} | {r['error']:+.1%} |", flush=True)


if __name__ == "__main__":
    main()
