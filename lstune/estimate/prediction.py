"""`predict(config, hardware)` → `Estimate`: a configuration's engine (`choose_engine`), per-rank device and host
bytes, verdict, step time and longest sequence — the planner's modules composed (lstune.estimate.choice, .longest)
over the byte model (lstune.estimate.memory) and the FLOPs (lstune.estimate.flops). lstune.estimate.planner adds
the cheapest changes (`estimate`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from lstune.config.schema import TrainConfig
from lstune.estimate.choice import (MemoryChoice, choose_memory, engine_candidates, fits_some_choice,
                                    reach_candidates)
from lstune.estimate.copies import StepCopies, step_copies
from lstune.estimate.flops import KernelFlops, StepFlops, kernel_flops, step_flops
from lstune.estimate.hardware import Cluster
from lstune.estimate.longest import longest_reach, longest_seq_len
from lstune.estimate.memory import (Breakdown, Engine, attn_chunk_count, breakdown, loss_backend,
                                    saved_checkpoint_min_bytes)
from lstune.estimate.placement import extra_layer_forwards, placement_summary
from lstune.estimate.margin import Margin
from lstune.estimate.preset_facts import counts_for
from lstune.estimate.settings import device_capacity, host_capacity, model_config_of, resolve_sp, run_margin, settings
from lstune.estimate.shapes import ModelShape, ParamCounts


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
    longest_seq_len: int  # the longest sequence (multiple of 1024) this configuration fits (`longest_reach`)
    memory_choice: "MemoryChoice | None" = None  # what the `auto` memory settings resolved to (what train applies)
    copies: StepCopies = field(default_factory=StepCopies)  # host <-> device bytes of one step
    suggestions: list[Any] = field(default_factory=list)  # lstune.estimate.suggestions.Suggestion
    notes: list[str] = field(default_factory=list)
    # The step's FLOPs by kernel, (with recompute as run, without any): lstune.estimate.flops.kernel_flops.
    kernels: tuple[KernelFlops, KernelFlops] | None = None

    @property
    def device_peak_bytes(self) -> int:
        return self.breakdown.device_peak

    @property
    def host_peak_bytes(self) -> int:
        """Per node: every rank's host bytes."""
        return self.breakdown.host_peak * self.hardware.gpus

    @property
    def margin(self) -> Margin:
        """What a fit leaves free (lstune.estimate.margin): `fits` means the peaks stay this far below capacity."""
        return run_margin(self.hardware, self.breakdown)

    @property
    def fits_device(self) -> bool:
        return self.device_peak_bytes <= self.device_capacity - self.margin.device

    @property
    def fits_host(self) -> bool:
        return self.host_peak_bytes <= self.host_capacity - self.margin.host

    @property
    def fits(self) -> bool:
        return self.fits_device and self.fits_host

    @property
    def saved_checkpoint_min_bytes(self) -> int:
        """Disk bytes one saved checkpoint takes at least, over all ranks (memory.saved_checkpoint_min_bytes)."""
        return saved_checkpoint_min_bytes(self.params)

    @property
    def tokens_per_second(self) -> float:
        dp = self.hardware.world_size // self.sp
        return dp * self.flops.tokens / self.step_seconds if self.step_seconds else 0.0

    @property
    def mfu(self) -> float:
        """Predicted model FLOPs per device and second over the device's bf16 dense peak (docs/bench.md)."""
        return self._utilisation(self.flops.model)

    @property
    def hfu(self) -> float:
        """The same with the hardware FLOPs: recompute counted."""
        return self._utilisation(self.flops.hardware)

    def _utilisation(self, flops: float) -> float:
        if not self.step_seconds:
            return 0.0
        return flops / self.sp / self.step_seconds / (self.hardware.device.peak_tflops * 1e12)

    @property
    def ideal_seconds(self) -> tuple[float, float] | None:
        """(with recompute as run, without any): the step's kernels alone at the device's measured kernel rates
        (lstune.estimate.hardware), one device's share; None without rates (a CPU)."""
        d = self.hardware.device
        if not (self.kernels and d.gemm_kernel_tflops):
            return None
        rates = (d.gemm_kernel_tflops * 1e12, d.attention_forward_kernel_tflops * 1e12,
                 d.attention_backward_kernel_tflops * 1e12)
        run, bare = (k.ideal_seconds(*rates) / self.sp for k in self.kernels)
        return run, bare

    def verdict(self) -> str:
        m = self.margin
        if self.fits:
            spare = self.device_capacity - m.device - self.device_peak_bytes
            return (f"fits: {spare / 2**30:,.1f} GiB to spare per device beyond the {m.device_share:.0%} margin "
                    f"({m.device / 2**30:,.1f} GiB)")
        where = [w for w, ok in (("device", self.fits_device), ("host", self.fits_host)) if not ok]
        within = (self.device_peak_bytes <= self.device_capacity and self.host_peak_bytes <= self.host_capacity)
        return (f"does not fit ({' and '.join(where)} memory" + (", inside the capacity but not its margin: "
                "--force to try" if within else "") + ")")

    def to_dict(self) -> dict:
        return {
            "model": self.model, "seq_len": self.seq_len, "local_seq_len": math.ceil(self.seq_len / self.sp),
            "hardware": self.hardware.to_dict(), "engine": self.engine.to_dict(), "sp": self.sp,
            "dp": self.hardware.world_size // self.sp, "dtypes": self.breakdown.dtypes,
            "parameters": self.params.to_dict(), "breakdown": [i.to_dict() for i in self.breakdown.items],
            "peak_phase": self.breakdown.phase,
            "checkpoint_bytes_per_token_layer": self.breakdown.checkpoint_bytes_per_token_layer,
            "recompute_attention": "off" if self.breakdown.attention_saved_layers else "on",
            "attention_saved_bytes_per_token_layer": self.breakdown.attention_saved_bytes_per_token_layer,
            "device_peak_bytes": self.device_peak_bytes, "device_capacity_bytes": self.device_capacity,
            "host_peak_bytes": self.host_peak_bytes, "host_capacity_bytes": self.host_capacity,
            "fits": self.fits, "fits_device": self.fits_device, "fits_host": self.fits_host, "verdict": self.verdict(),
            "margin": self.margin.to_dict(),
            "longest_seq_len": self.longest_seq_len, "flops": self.flops.to_dict(),
            "saved_checkpoint_min_bytes": self.saved_checkpoint_min_bytes,
            "checkpoint_placement": placement_summary(self.breakdown.placement, self.flops),
            "step_seconds": self.step_seconds, "tokens_per_second": self.tokens_per_second,
            "mfu": self.mfu, "hfu": self.hfu,
            "ideal_seconds": self.ideal_seconds[0] if self.ideal_seconds else None,
            "ideal_no_recompute_seconds": self.ideal_seconds[1] if self.ideal_seconds else None,
            "host_copies": self.copies.to_dict(),
            "memory_choice": self.memory_choice.to_dict() if self.memory_choice else None,
            "suggestions": [s.to_dict() for s in self.suggestions], "notes": list(self.notes),
        }


def predict(config: TrainConfig, hardware: Cluster, *, model_config: Any = None, params: ParamCounts | None = None,
            resolve_auto: bool = True, reach: bool = True) -> Estimate:
    """The estimate of `config` on `hardware` without suggestions (lstune.estimate.planner.estimate adds them):
    the engine (`choose_engine`), the `auto` memory settings (`choose_memory`; `resolve_auto=False`: as the
    memory plan applies them unresolved), the peaks and step time, the longest sequence (`reach`)."""
    model_config = model_config if model_config is not None else model_config_of(config)
    shape = ModelShape.from_config(model_config)
    config = attention_free_config(config, shape, getattr(model_config, "model_type", "?"))
    params = params or counts_for(model_config, lora_r=config.model.lora_r, lora_targets=config.model.lora_targets,
                                  trust_remote_code=config.model.trust_remote_code)
    sp = resolve_sp(config, hardware, model_config)
    engine = choose_engine(config, hardware, shape, params, sp)
    choice = choose_memory(config, hardware, shape, params, sp, engine) if resolve_auto else None
    result = _evaluate(choice.applied_to(config) if choice else config, hardware, shape, params, sp, engine,
                       model_config)
    result.memory_choice = choice
    result.longest_seq_len = longest_reach(config, hardware, shape, params, sp, engine) if reach else 0
    return result


def attention_free_config(config: TrainConfig, shape: ModelShape, model_type: str) -> TrainConfig:
    """`config` for a model without attention (ModelShape.attention_free: Mamba, FalconMamba, Mamba-2): the
    attention-only settings' `auto` resolved to off (no chunked attention, nothing of attention's to keep or
    recompute, no ring); an explicit one refused, naming the fix. Any other model's `config` unchanged."""
    if not shape.attention_free:
        return config
    m, par = config.memory, config.parallel
    asked = [flag for flag, value, allowed in (("--attn-chunks", m.attn_chunks, ("auto", "off")),
                                               ("--recompute-attention", m.recompute_attention, ("auto",)),
                                               ("--sp-ring", par.sp_ring, ("auto", 1, "1")))
             if value not in allowed]
    if asked:
        from lstune.errors import ConfigError

        raise ConfigError([f"{', '.join(asked)} apply to attention, and {model_type} has none (a pure state-space "
                          f"model); leave {' and '.join(asked)} out (their `auto` is off for it)."])
    return replace(config, memory=replace(m, attn_chunks="off", recompute_attention="on"),
                   parallel=replace(par, sp_ring=1))


def choose_engine(config: TrainConfig, hardware: Cluster, shape: ModelShape, params: ParamCounts, sp: int) -> Engine:
    """The first candidate whose device and host peaks fit; when none does, the one that fits the longest
    sequence (the first of equals)."""
    candidates = engine_candidates(config, hardware)
    for engine in candidates:
        if fits_some_choice(config, hardware, shape, params, sp, engine):
            return engine
    candidates = reach_candidates(candidates)
    reach = [longest_seq_len(config, hardware, shape, params, sp, engine) for engine in candidates]
    return candidates[reach.index(max(reach))]


def traced_settings_estimate(config: TrainConfig, hardware: Cluster, model_config, analytic: Estimate) -> Estimate:
    """The analytic model of what `lstune estimate --trace` runs for `config` as given (no choice made again): the
    same rank and engine as `analytic`, the step of `Cluster.traced` (the CPU's loss head, no fused norms, chunks
    read in place, no CUDA context)."""
    s = settings(config, replace(hardware, traced=True), analytic.sp, analytic.engine)
    b = breakdown(ModelShape.from_config(model_config), analytic.params, s)
    return replace(analytic, breakdown=b, suggestions=[])


def _evaluate(config, hardware, shape, params, sp, engine, model_config) -> Estimate:
    s = settings(config, hardware, sp, engine)
    b = breakdown(shape, params, s)
    chunks = attn_chunk_count(s.attn_chunks, shape, math.ceil(s.seq_len / sp))
    flops = step_flops(model_config, config.data.seq_len, lora=bool(config.model.lora_r),
                       checkpointing=config.memory.checkpointing, lora_r=config.model.lora_r or 16,
                       # METP's backward re-runs each rotation step's forward, as an MLP tile does
                       tiled_mlp=config.memory.tiled_mlp != "off" or s.metp_mlp, tiled_loss=loss_backend(s) not in ("off",),
                       extra_layer_forwards=extra_layer_forwards(b.placement),  # issue 14: recomputed checkpoints
                       attn_chunked=chunks > 1, attention_saved_layers=b.attention_saved_layers)
    flops = _scaled(flops, config.optim.micro_batch_size)
    rounds = micro_batches_per_step(config, sp)
    copies = _repeated(step_copies(shape, s, b, flops, hardware, chunks), rounds)
    flops = _scaled(flops, rounds)
    return Estimate(
        model=config.model.name, seq_len=config.data.seq_len, hardware=hardware, engine=engine, sp=sp, breakdown=b,
        params=params, flops=flops, copies=copies, kernels=kernel_flops(flops, model_config, config.data.seq_len),
        step_seconds=step_seconds(flops, hardware, sp, engine, params) + copies.exposed_seconds,
        device_capacity=device_capacity(hardware), host_capacity=host_capacity(hardware), longest_seq_len=0,
        notes=_notes(config, shape, sp, hardware.world_size),
    )


def micro_batches_per_step(config: TrainConfig, sp: int) -> int:
    """The micro-batches an SP group runs one after the other in one optimizer step, as `lstune train` steps
    (lstune.train.step.Stepper: grad-accum rounds, each of one micro-batch from every rank of the group; docs/bench.md:
    a step is one sequence × micro-batch × grad-accum × processes). Memory is one micro-batch's; FLOPs, copies and
    time are the step's."""
    return config.optim.grad_accum * sp


def _scaled(flops: StepFlops, times: int) -> StepFlops:
    """`flops` of `times` sequences (a micro-batch's, or a step's micro-batches)."""
    if times == 1:
        return flops
    return StepFlops(*(x * times for x in (flops.model, flops.hardware, flops.hardware_matmul,
                                           flops.hardware_attention)), flops.tokens * times,
                     flops.recompute_extra * times)


def _repeated(copies: StepCopies, times: int) -> StepCopies:
    """One micro-batch's copies `times` over: each micro-batch offloads and fetches its own checkpoints."""
    if times == 1:
        return copies
    return StepCopies(copies.checkpoint_bytes * times, copies.chunk_out_bytes * times, copies.chunk_in_bytes * times,
                      copies.exposed_seconds * times)


def step_seconds(flops: StepFlops, hardware: Cluster, sp: int, engine: Engine, params: ParamCounts) -> float:
    """One optimizer step (`flops`: every micro-batch of it): the SP group shares the sequence's FLOPs; matmuls and
    attention at the device's sustained rates; with the optimizer on the host, once a step, ~2 ns per parameter of
    the rank's shard for DeepSpeed's CPU Adam (an order of magnitude, not measured here)."""
    d = hardware.device
    compute = (flops.hardware_matmul / (d.matmul_tflops * 1e12) + flops.hardware_attention / (d.attention_tflops * 1e12)) / sp
    host_adam = params.trainable / hardware.world_size * 2e-9 * engine.offload_ratio if engine.offload_optimizer else 0.0
    return compute + host_adam


def _notes(config: TrainConfig, shape: ModelShape, sp: int, world: int = 1) -> list[str]:
    notes = []
    if config.parallel.sp == "auto" and sp < world:
        # More GPUs past this SP degree make the step no shorter: they run more sequences at once (DP).
        dp = world // sp
        notes.append(f"SP stops at {sp} of the {world} GPUs: Ulysses gives each rank an equal share of whole "
                     f"query heads (this model has {shape.heads}), so the other GPUs run DP {dp}: {dp} sequences a "
                     "step in the same step time (tokens/s × DP), not a shorter step; --sp-ring splits the sequence "
                     "past the heads (ring attention, docs/parallel.md), --sp N trades otherwise.")
    local = math.ceil(config.data.seq_len / sp)
    if local * shape.hidden >= 2**31:
        notes.append(f"{local:,} local tokens × hidden {shape.hidden} reach 2^31 elements: kernels outside the tiles "
                     f"may overflow int32; keep the local sequence below {2**31 // shape.hidden:,} (raise SP).")
    return notes


def _explicit_chunks(config: Any, sp: int) -> int:
    """The attention chunks a `--attn-chunks N` run cuts its local sequence into (1 for off or an unresolved auto)."""
    setting = config.memory.attn_chunks
    return 1 if setting in ("off", "auto") else max(1, min(int(setting), math.ceil(config.data.seq_len / sp)))


def sp_report(config: Any, hardware: Any, model_config: Any = None) -> dict | None:
    """The split of `config`'s SP degree on `hardware`, one rank's traffic per step and its time (`sp_traffic`), and
    with --metp-mlp METP's MLP against ZeRO-3 + tiled MLP (`mlp_comparison`) — all PREDICTED; None without SP."""
    from lstune.estimate.metp_table import mlp_comparison
    from lstune.estimate.sequence_parallel import sp_traffic
    from lstune.estimate.settings import model_config_of, resolve_ring, resolve_sp
    from lstune.estimate.shapes import ModelShape

    if hardware.world_size == 1:
        return None  # no SP: nothing to read (a preset's estimate imports neither torch nor transformers)
    model_config = model_config if model_config is not None else model_config_of(config)
    sp = resolve_sp(config, hardware, model_config)
    if sp <= 1:
        return None
    ring = resolve_ring(config, hardware, sp)
    shape = ModelShape.from_config(model_config)
    act = 4 if config.model.dtype == "fp32" or not hardware.on_cuda else 2
    common = dict(seq_len=config.data.seq_len, micro_batch=config.optim.micro_batch_size, sp=sp)
    traffic = sp_traffic(shape, ring=ring, act_bytes=act, metp_mlp=bool(config.parallel.metp_mlp),
                         checkpointing=config.memory.checkpointing, micro_batches=config.optim.grad_accum * sp,
                         attention_flops_per_s=hardware.device.attention_tflops * 1e12, node_size=hardware.gpus,
                         ring_gathered=_explicit_chunks(config, sp) > 1, metp_trainable=not config.model.lora_r,
                         **common)
    report = {"label": "predicted", "traffic": traffic.to_dict()}
    if config.parallel.metp_mlp:
        tiles = config.memory.tiled_mlp if isinstance(config.memory.tiled_mlp, int) else max(
            1, -(-config.data.seq_len // sp // shape.hidden))
        report["mlp"] = mlp_comparison(shape, world=hardware.world_size, tiles=tiles, param_bytes=act, act_bytes=act,
                                       trainable=not config.model.lora_r,
                                       checkpointing=config.memory.checkpointing, **common).to_dict()
    return report
