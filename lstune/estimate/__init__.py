"""`estimate(config, hardware)`: will this run fit, where do its bytes go, how long is a step — before anything
is loaded or rented.

One model for `lstune estimate` and for `lstune train`'s automatic choices: the engine (single-device AdamW or
DeepSpeed ZeRO 1-3, with optimizer / parameter offload) is the first of `engine_candidates` whose predicted
peak fits the device, so a choice never disagrees with the estimate shown for it. The byte model is
lstune.estimate.memory (analytic, per rank), the FLOPs lstune.estimate.flops, the hardware
lstune.estimate.hardware; `lstune estimate --trace` measures the same step on fake tensors
(lstune.train.trace). docs/estimate.md explains each term and how close it comes to measurements.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from lstune.config.schema import TrainConfig, zero_problems
from lstune.errors import ConfigError
from lstune.estimate.flops import StepFlops, step_flops
from lstune.estimate.hardware import Cluster
from lstune.estimate.memory import Breakdown, Engine, Settings, breakdown, loss_backend, reserve_bytes
from lstune.estimate.placement import extra_layer_forwards, placement_summary
from lstune.estimate.shapes import ModelShape, ParamCounts, count_parameters

MIN_SEQ = 1024


@dataclass
class Estimate:
    """The answer for one configuration on one cluster (per rank unless said otherwise)."""

    model: str
    seq_len: int
    hardware: Cluster
    engine: Engine
    sp: int
    breakdown: Breakdown
    params: ParamCounts
    flops: StepFlops
    step_seconds: float
    device_capacity: int  # bytes the allocator can hand out on one device
    host_capacity: int  # bytes of host memory on one node
    longest_seq_len: int  # the longest sequence (multiple of 1024) this configuration fits
    suggestions: list["Suggestion"] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def device_peak_bytes(self) -> int:
        return self.breakdown.device_peak

    @property
    def host_peak_bytes(self) -> int:
        """Per node: every rank's host bytes."""
        return self.breakdown.host_peak * self.hardware.gpus

    @property
    def fits_device(self) -> bool:
        return self.device_peak_bytes <= self.device_capacity

    @property
    def fits_host(self) -> bool:
        return self.host_peak_bytes <= self.host_capacity

    @property
    def fits(self) -> bool:
        return self.fits_device and self.fits_host

    @property
    def tokens_per_second(self) -> float:
        dp = self.hardware.world_size // self.sp
        return dp * self.flops.tokens / self.step_seconds if self.step_seconds else 0.0

    def verdict(self) -> str:
        if self.fits:
            margin = self.device_capacity - self.device_peak_bytes
            return f"fits: {margin / 2**30:,.1f} GiB to spare per device"
        where = [w for w, ok in (("device", self.fits_device), ("host", self.fits_host)) if not ok]
        return f"does not fit ({' and '.join(where)} memory)"

    def to_dict(self) -> dict:
        return {
            "model": self.model, "seq_len": self.seq_len, "local_seq_len": math.ceil(self.seq_len / self.sp),
            "hardware": self.hardware.to_dict(), "engine": self.engine.to_dict(), "sp": self.sp,
            "dp": self.hardware.world_size // self.sp, "dtypes": self.breakdown.dtypes,
            "parameters": self.params.to_dict(), "breakdown": [i.to_dict() for i in self.breakdown.items],
            "peak_phase": self.breakdown.phase,
            "checkpoint_bytes_per_token_layer": self.breakdown.checkpoint_bytes_per_token_layer,
            "device_peak_bytes": self.device_peak_bytes, "device_capacity_bytes": self.device_capacity,
            "host_peak_bytes": self.host_peak_bytes, "host_capacity_bytes": self.host_capacity,
            "fits": self.fits, "fits_device": self.fits_device, "fits_host": self.fits_host, "verdict": self.verdict(),
            "longest_seq_len": self.longest_seq_len, "flops": self.flops.to_dict(),
            "checkpoint_placement": placement_summary(self.breakdown.placement, self.flops),
            "step_seconds": self.step_seconds, "tokens_per_second": self.tokens_per_second,
            "suggestions": [s.to_dict() for s in self.suggestions], "notes": list(self.notes),
        }


@dataclass(frozen=True)
class Suggestion:
    """A change to the configuration (as flags) with its predicted peak and step time."""

    flags: str
    device_peak_bytes: int
    host_peak_bytes: int
    step_seconds: float
    fits: bool

    def to_dict(self) -> dict:
        return {"flags": self.flags, "device_peak_bytes": self.device_peak_bytes,
                "host_peak_bytes": self.host_peak_bytes, "step_seconds": self.step_seconds, "fits": self.fits}


def estimate(config: TrainConfig, hardware: Cluster, *, model_config: Any = None, params: ParamCounts | None = None,
             suggest: bool = True) -> Estimate:
    """The estimate of `config` on `hardware` (a Cluster from `resolve_hardware`). `model_config`: the model's
    transformers config when already resolved (else read from `config.model.name`); `params`: counts when
    already made (a search calls this many times)."""
    model_config = model_config if model_config is not None else _model_config(config)
    shape = ModelShape.from_config(model_config)
    params = params or count_parameters(model_config, lora_r=config.model.lora_r,
                                        lora_targets=config.model.lora_targets,
                                        trust_remote_code=config.model.trust_remote_code)
    sp = resolve_sp(config, hardware, model_config)
    engine = choose_engine(config, hardware, shape, params, sp)
    result = _evaluate(config, hardware, shape, params, sp, engine, model_config)
    result.longest_seq_len = longest_seq_len(config, hardware, shape, params, sp, engine)
    if suggest and not result.fits:
        result.suggestions = cheapest_changes(config, hardware, model_config, params)
    return result


def traced_settings_estimate(config: TrainConfig, hardware: Cluster, model_config, analytic: Estimate) -> Estimate:
    """The analytic estimate of what `lstune estimate --trace` runs: the same rank and engine, the CPU's loss head
    (ALST tiles, no Liger), mini-sequence without fused norms (finding them needs a probe on real weights), no CUDA
    context (the trace sees only tensors)."""
    s = replace(settings(config, hardware, analytic.sp, analytic.engine), liger=False, fuse_norms=False)
    shape = ModelShape.from_config(model_config)
    b = breakdown(shape, analytic.params, s)
    b.items = [i for i in b.items if not i.name.startswith("CUDA context")]
    return replace(analytic, breakdown=b, suggestions=[])


def _model_config(config: TrainConfig):
    from lstune.models.loading import resolve_model

    return resolve_model(config.model.name, trust_remote_code=config.model.trust_remote_code).config


def resolve_sp(config: TrainConfig, hardware: Cluster, model_config) -> int:
    """The SP degree the run would use (ConfigError naming the valid ones when it cannot)."""
    from lstune.parallel.dims import ParallelDims

    text = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    return ParallelDims.for_model(hardware.world_size, config.parallel.sp, text).sp


def settings(config: TrainConfig, hardware: Cluster, sp: int, engine: Engine) -> Settings:
    m = config.memory
    return Settings(
        seq_len=config.data.seq_len, micro_batch=config.optim.micro_batch_size, sp=sp, world=hardware.world_size,
        engine=engine, lora_r=config.model.lora_r, on_cuda=hardware.on_cuda,
        dtype=config.model.dtype, tiled_mlp=m.tiled_mlp, tiled_loss=m.tiled_loss, mini_sequence=m.mini_sequence,
        checkpointing=m.checkpointing, offload_checkpoints=m.offload_checkpoints, host_mem_budget=m.host_mem_budget,
        load_in_4bit=config.model.load_in_4bit, checkpoint_device_budget=m.checkpoint_device_budget,
    )


def engine_candidates(config: TrainConfig, hardware: Cluster) -> list[Engine]:
    """The engines `--zero-stage auto` may pick, least communication and host traffic first; the given stage and
    offloads alone otherwise."""
    p = config.parallel
    world = hardware.world_size
    problems = zero_problems(p.zero_stage, processes=world, offload_optimizer=bool(p.offload_optimizer),
                             offload_params=bool(p.offload_params))
    if problems:
        raise ConfigError(problems)
    if p.zero_stage != "auto":
        stage = int(p.zero_stage)
        if stage == 0:
            return [Engine("torch")]
        return [Engine("deepspeed", stage, bool(p.offload_optimizer), bool(p.offload_params))]
    if p.offload_optimizer or p.offload_params:
        return [Engine("deepspeed", 3, True if p.offload_optimizer is None else bool(p.offload_optimizer),
                       bool(p.offload_params))]
    plain = [Engine("torch")] if world == 1 else [Engine("deepspeed", s) for s in (1, 2, 3)]
    offloads = [Engine("deepspeed", 3, True, False), Engine("deepspeed", 3, True, True)]
    if p.offload_optimizer is False:
        offloads = [e for e in offloads if not e.offload_optimizer]
    if p.offload_params is False:
        offloads = [e for e in offloads if not e.offload_params]
    return plain + offloads if hardware.on_cuda else plain[:1]


def choose_engine(config: TrainConfig, hardware: Cluster, shape: ModelShape, params: ParamCounts, sp: int) -> Engine:
    """The first candidate whose device and host peaks fit; when none does, the one that fits the longest
    sequence (the first of equals)."""
    candidates = engine_candidates(config, hardware)
    for engine in candidates:
        if _fits(breakdown(shape, params, settings(config, hardware, sp, engine)), hardware):
            return engine
    reach = [longest_seq_len(config, hardware, shape, params, sp, engine) for engine in candidates]
    return candidates[reach.index(max(reach))]


def _fits(b: Breakdown, hardware: Cluster) -> bool:
    return b.device_peak <= device_capacity(hardware) and b.host_peak * hardware.gpus <= hardware.host_bytes


def device_capacity(hardware: Cluster) -> int:
    return hardware.device.device_bytes - reserve_bytes(hardware.device.device_bytes, hardware.on_cuda)


def _evaluate(config, hardware, shape, params, sp, engine, model_config) -> Estimate:
    s = settings(config, hardware, sp, engine)
    b = breakdown(shape, params, s)
    flops = step_flops(model_config, config.data.seq_len, lora=bool(config.model.lora_r),
                       checkpointing=config.memory.checkpointing, lora_r=config.model.lora_r or 16,
                       tiled_mlp=config.memory.tiled_mlp != "off", tiled_loss=loss_backend(s) not in ("off",),
                       extra_layer_forwards=extra_layer_forwards(b.placement))  # issue 14: recomputed checkpoints
    flops = _scaled(flops, config.optim.micro_batch_size)
    return Estimate(
        model=config.model.name, seq_len=config.data.seq_len, hardware=hardware, engine=engine, sp=sp, breakdown=b,
        params=params, flops=flops, step_seconds=step_seconds(flops, hardware, sp, engine, params),
        device_capacity=device_capacity(hardware), host_capacity=hardware.host_bytes, longest_seq_len=0,
        notes=_notes(config, shape, sp),
    )


def _scaled(flops: StepFlops, micro_batch: int) -> StepFlops:
    if micro_batch == 1:
        return flops
    return StepFlops(*(x * micro_batch for x in (flops.model, flops.hardware, flops.hardware_matmul,
                                                 flops.hardware_attention)), flops.tokens * micro_batch,
                     flops.recompute_extra * micro_batch)


def step_seconds(flops: StepFlops, hardware: Cluster, sp: int, engine: Engine, params: ParamCounts) -> float:
    """One optimizer step of one micro-batch: the SP group shares the sequence's FLOPs; matmuls and attention at
    the device's sustained rates; with the optimizer on the host, ~2 ns per parameter of the rank's shard for
    DeepSpeed's CPU Adam (an order of magnitude, not measured here)."""
    d = hardware.device
    compute = (flops.hardware_matmul / (d.matmul_tflops * 1e12) + flops.hardware_attention / (d.attention_tflops * 1e12)) / sp
    host_adam = params.trainable / hardware.world_size * 2e-9 if engine.offload_optimizer else 0.0
    return compute + host_adam


def longest_seq_len(config, hardware, shape, params, sp, engine) -> int:
    """The longest sequence (a multiple of 1024 · SP) whose peaks fit, with everything else unchanged."""
    step = MIN_SEQ * sp

    def fits(n: int) -> bool:
        return _fits(breakdown(shape, params, settings(_with(config, seq_len=n), hardware, sp, engine)), hardware)

    if not fits(step):
        return 0
    low, high = 1, 2
    while fits(high * step) and high < 2**24:
        low, high = high, high * 2
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid * step) else (low, mid)
    return low * step


def _with(config: TrainConfig, **flat: Any) -> TrainConfig:
    """A copy of `config` with some flat keys changed (`seq_len`, `offload_checkpoints`, ...)."""
    values = config.to_dict()
    values.update(flat)
    return TrainConfig.from_flat(values)


# Changes tried, in order of cost: memory techniques first (no extra hardware), then more sharding/offload.
_CHANGES: list[tuple[str, dict]] = [
    ("--tiled-loss auto", {"tiled_loss": "auto"}),
    ("--tiled-mlp auto", {"tiled_mlp": "auto"}),
    ("--checkpointing on", {"checkpointing": True}),
    ("--offload-checkpoints", {"checkpointing": True, "offload_checkpoints": True}),
    ("--mini-sequence --offload-checkpoints", {"checkpointing": True, "offload_checkpoints": True,
                                               "mini_sequence": True, "tiled_mlp": "auto"}),
    ("--zero-stage 3 --offload-optimizer", {"zero_stage": "3", "offload_optimizer": True}),
    ("--zero-stage 3 --offload-optimizer --offload-params", {"zero_stage": "3", "offload_optimizer": True,
                                                             "offload_params": True}),
]


def cheapest_changes(config: TrainConfig, hardware: Cluster, model_config, params: ParamCounts,
                     limit: int = 5) -> list[Suggestion]:
    """Changes that would fit the requested length (each with its peaks and step time), cheapest first; more
    GPUs for sequence parallelism when no single-node change does."""
    found: list[Suggestion] = []
    current = config.to_dict()
    for flags, change in _CHANGES:
        if all(current.get(k) == v for k, v in change.items()):
            continue
        found += _try(config, hardware, model_config, params, flags, change)
        if len(found) >= limit:
            break
    combined = {k: v for _, change in _CHANGES[3:5] for k, v in change.items()}
    if not any(s.fits for s in found):
        for gpus in (2, 4, 8):
            if gpus > hardware.gpus:
                more = replace(hardware, gpus=gpus)
                found += _try(config, more, model_config, params, f"--gpus {gpus} --offload-checkpoints --mini-sequence",
                              {**combined, "sp": "auto", "gpus": gpus})
                if found and found[-1].fits:
                    break
    fitting = [s for s in found if s.fits]
    return (fitting or found)[:limit]


def _try(config, hardware, model_config, params, flags, change) -> list[Suggestion]:
    try:
        changed = _with(config, **change)
        if changed.problems():
            return []
        e = estimate(changed, hardware, model_config=model_config, params=params, suggest=False)
    except ConfigError:
        return []
    return [Suggestion(flags, e.device_peak_bytes, e.host_peak_bytes, e.step_seconds, e.fits)]


def _notes(config: TrainConfig, shape: ModelShape, sp: int) -> list[str]:
    notes = []
    local = math.ceil(config.data.seq_len / sp)
    if local * shape.hidden >= 2**31:
        notes.append(f"{local:,} local tokens × hidden {shape.hidden} reach 2^31 elements: kernels outside the tiles "
                     f"may overflow int32; keep the local sequence below {2**31 // shape.hidden:,} (raise SP).")
    return notes


__all__ = ["Estimate", "Suggestion", "estimate", "StepFlops", "step_flops", "Cluster", "choose_engine",
           "engine_candidates", "longest_seq_len", "cheapest_changes"]
