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
from typing import Any, Iterator

from lstune.config.schema import FLAT_FIELDS, TrainConfig, flag_name, zero_problems
from lstune.errors import ConfigError
from lstune.estimate.copies import StepCopies, step_copies
from lstune.estimate.flops import StepFlops, step_flops
from lstune.estimate.hardware import Cluster
from lstune.estimate.memory import (LOSS_TILE_BYTES, Breakdown, Engine, Settings, attn_chunk_count, breakdown,
                                    host_reserve_bytes, loss_backend, reserve_bytes, saved_checkpoint_min_bytes,
                                    size_text)
from lstune.estimate.placement import extra_layer_forwards, placement_summary
from lstune.estimate.shapes import ModelShape, ParamCounts, count_parameters

MIN_SEQ = 1024
# `auto` tiling stops cutting once the predicted peak is at most this share of the device: tiles cost time, and
# the few percent the estimate may be off (docs/estimate.md) plus the allocator's fragmentation need room.
AUTO_HEADROOM = 0.9


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
    def saved_checkpoint_min_bytes(self) -> int:
        """Disk bytes one saved checkpoint takes at least, over all ranks (memory.saved_checkpoint_min_bytes)."""
        return saved_checkpoint_min_bytes(self.params)

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
            "recompute_attention": "off" if self.breakdown.attention_saved_layers else "on",
            "attention_saved_bytes_per_token_layer": self.breakdown.attention_saved_bytes_per_token_layer,
            "device_peak_bytes": self.device_peak_bytes, "device_capacity_bytes": self.device_capacity,
            "host_peak_bytes": self.host_peak_bytes, "host_capacity_bytes": self.host_capacity,
            "fits": self.fits, "fits_device": self.fits_device, "fits_host": self.fits_host, "verdict": self.verdict(),
            "longest_seq_len": self.longest_seq_len, "flops": self.flops.to_dict(),
            "saved_checkpoint_min_bytes": self.saved_checkpoint_min_bytes,
            "checkpoint_placement": placement_summary(self.breakdown.placement, self.flops),
            "step_seconds": self.step_seconds, "tokens_per_second": self.tokens_per_second,
            "host_copies": self.copies.to_dict(),
            "memory_choice": self.memory_choice.to_dict() if self.memory_choice else None,
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
             suggest: bool = True, resolve_auto: bool = True, reach: bool = True) -> Estimate:
    """The estimate of `config` on `hardware` (a Cluster from `resolve_hardware`). `model_config`: the model's
    transformers config when already resolved (else read from `config.model.name`); `params`: counts when
    already made (a search calls this many times). `resolve_auto=False`: the memory settings as the memory plan
    applies them unresolved (`auto` tiles at ALST's counts, `auto` offload off; no `memory_choice`) — what a
    bench ladder rung runs. `reach=False`: no longest sequence searched (`longest_seq_len` 0), for a suggestion."""
    model_config = model_config if model_config is not None else _model_config(config)
    shape = ModelShape.from_config(model_config)
    params = params or count_parameters(model_config, lora_r=config.model.lora_r,
                                        lora_targets=config.model.lora_targets,
                                        trust_remote_code=config.model.trust_remote_code)
    sp = resolve_sp(config, hardware, model_config)
    engine = choose_engine(config, hardware, shape, params, sp)
    choice = choose_memory(config, hardware, shape, params, sp, engine) if resolve_auto else None
    result = _evaluate(choice.applied_to(config) if choice else config, hardware, shape, params, sp, engine,
                       model_config)
    result.memory_choice = choice
    result.longest_seq_len = longest_reach(config, hardware, shape, params, sp, engine) if reach else 0
    if suggest and not result.fits:
        result.suggestions = cheapest_changes(config, hardware, model_config, params)
    return result


def traced_settings_estimate(config: TrainConfig, hardware: Cluster, model_config, analytic: Estimate) -> Estimate:
    """The analytic estimate of what `lstune estimate --trace` runs: the same rank and engine, the CPU's loss head
    (ALST tiles, no Liger), mini-sequence without fused norms (finding them needs a probe on real weights), offloaded
    attention chunks read in place (no device copies on CPU), no CUDA context (the trace sees only tensors)."""
    s = replace(settings(config, hardware, analytic.sp, analytic.engine), liger=False, fuse_norms=False,
                chunks_fetched=False)
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


def settings(config: TrainConfig, hardware: Cluster, sp: int, engine: Engine, offload: bool | None = None) -> Settings:
    """The byte model's settings of `config`; `offload`: checkpoint offload as resolved (default: on only when the
    config says so outright, 'auto' being the estimate's choice, `choose_memory`)."""
    m = config.memory
    offload = m.offload_checkpoints is True if offload is None else offload
    return Settings(
        seq_len=config.data.seq_len, micro_batch=config.optim.micro_batch_size, sp=sp, world=hardware.world_size,
        engine=engine, lora_r=config.model.lora_r, lora_dropout=config.model.lora_dropout, on_cuda=hardware.on_cuda,
        dtype=config.model.dtype, tiled_mlp=m.tiled_mlp, tiled_loss=m.tiled_loss, mini_sequence=m.mini_sequence is True,
        checkpointing=m.checkpointing, offload_checkpoints=offload, host_mem_budget=m.host_mem_budget,
        grad_accum=config.optim.grad_accum, load_in_4bit=config.model.load_in_4bit,
        checkpoint_device_budget=m.checkpoint_device_budget, attn_chunks=m.attn_chunks,
        save_attention=m.checkpointing and m.recompute_attention == "off",
    )


AUTO_OFFLOAD_RATIOS = (0.75, 0.5, 0.25)  # the partial offloads `--zero-stage auto` tries first


def partial_offload_ratios() -> list[float]:
    """The --offload-ratio values `--zero-stage auto` tries, in order: AUTO_OFFLOAD_RATIOS, then every other k / n
    of the n optimizer sub-groups lstune cuts a rank's parameters into (the resolution DeepSpeed honours,
    lstune.parallel.engine_ds.PARTIAL_SUB_GROUPS), most on the host first. The fine ones matter where the fitting
    window is narrow: Llama-3.1-8B's full fine-tune at 16K on an H100 with a 112 GiB host fits only at 13/32 and
    14/32 (host 106.9 GiB at 14/32, 15 of DeepSpeed's 34 sub-groups on the host; the device is over at 12/32, the
    host at 15/32)."""
    from lstune.parallel.engine_ds import PARTIAL_SUB_GROUPS  # no torch: what the byte model imports too

    fine = [k / PARTIAL_SUB_GROUPS for k in range(PARTIAL_SUB_GROUPS - 1, 0, -1)]
    return [*AUTO_OFFLOAD_RATIOS, *(r for r in fine if r not in AUTO_OFFLOAD_RATIOS)]


def engine_candidates(config: TrainConfig, hardware: Cluster) -> list[Engine]:
    """The engines `--zero-stage auto` may pick, least communication and host traffic first; the given stage and
    offloads alone otherwise."""
    p = config.parallel
    world = hardware.world_size
    problems = zero_problems(p.zero_stage, processes=world, offload_optimizer=bool(p.offload_optimizer),
                             offload_params=bool(p.offload_params), offload_ratio=p.offload_ratio)
    if problems:
        raise ConfigError(problems)
    if p.zero_stage != "auto":
        stage = int(p.zero_stage)
        if stage == 0:
            return [Engine("torch")]
        return [Engine("deepspeed", stage, bool(p.offload_optimizer), bool(p.offload_params), p.offload_ratio)]
    if p.offload_optimizer or p.offload_params:
        return [Engine("deepspeed", 3, True if p.offload_optimizer is None else bool(p.offload_optimizer),
                       bool(p.offload_params))]
    plain = [Engine("torch")] if world == 1 else [Engine("deepspeed", s) for s in (1, 2, 3)]
    # Then part of the optimizer back on the device, for a host that cannot hold all of it (--offload-ratio).
    offloads = [Engine("deepspeed", 3, True, False), Engine("deepspeed", 3, True, True),
                *(Engine("deepspeed", 3, True, True, ratio) for ratio in partial_offload_ratios())]
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
        if _fits_some_choice(config, hardware, shape, params, sp, engine):
            return engine
    candidates = _reach_candidates(candidates)
    reach = [longest_seq_len(config, hardware, shape, params, sp, engine) for engine in candidates]
    return candidates[reach.index(max(reach))]


def longest_reach(config: TrainConfig, hardware: Cluster, shape: ModelShape, params: ParamCounts, sp: int,
                  chosen: Engine | None = None) -> int:
    """The longest sequence the configuration fits with the engine `--zero-stage auto` would pick at that length:
    the most of `longest_seq_len` over the engines it may pick (at a longer sequence it may pick a more offloaded
    engine than at this one — Llama-3.1-8B LoRA on one H100: 730K with AdamW on the device, 886K with ZeRO-3 and
    the parameters on the host), of the partial offloads AUTO_OFFLOAD_RATIOS' and `chosen`'s (the engine picked at
    the requested length; each search costs ~20 byte models, too many to make for all 31 ratios)."""
    engines = _reach_candidates(engine_candidates(config, hardware))
    if chosen is not None and chosen not in engines:
        engines.append(chosen)
    return max(longest_seq_len(config, hardware, shape, params, sp, e) for e in engines)


def _reach_candidates(candidates: list[Engine]) -> list[Engine]:
    """`candidates` less the fine partial offloads (`partial_offload_ratios`), unless only those are left."""
    coarse = [e for e in candidates if e.offload_ratio >= 1 or e.offload_ratio in AUTO_OFFLOAD_RATIOS]
    return coarse or list(candidates)


@dataclass(frozen=True)
class MemoryChoice:
    """What the `auto` memory settings resolve to for one run — `tiled_mlp` / `tiled_loss`: "off", a tile count, or
    "auto" where a policy decides per batch (Liger's chunks on CUDA, MST's tiles with --mini-sequence);
    `offload_checkpoints`, `mini_sequence`: on or off; `attn_chunks`: "off" or a chunk count (FPDT); the checkpoint
    placement's budgets (`placement_budgets`) — and why."""

    tiled_mlp: str | int
    tiled_loss: str | int
    offload_checkpoints: bool
    reason: str
    host_mem_budget: int | None = None  # bytes of host the offloaded checkpoints may use (None: no cap)
    checkpoint_device_budget: int | None = None  # device bytes checkpoints may use (None: no cap)
    attn_chunks: str | int = "off"
    mini_sequence: bool = False
    recompute_attention: str = "on"  # "off": attention's output kept beside each checkpoint (attention_saved)

    def applied_to(self, config: TrainConfig) -> TrainConfig:
        """`config` with these settings in its memory section (what lstune train prepares the model with)."""
        memory = replace(config.memory, tiled_mlp=self.tiled_mlp, tiled_loss=self.tiled_loss,
                         offload_checkpoints=self.offload_checkpoints, host_mem_budget=self.host_mem_budget,
                         checkpoint_device_budget=self.checkpoint_device_budget, attn_chunks=self.attn_chunks,
                         mini_sequence=self.mini_sequence, recompute_attention=self.recompute_attention)
        return replace(config, memory=memory)

    def describe(self) -> str:
        offload = "offloaded checkpoints" if self.offload_checkpoints else "no checkpoint offload"
        chunks = "" if self.attn_chunks == "off" else f", attention in {self.attn_chunks} chunks"
        mini = ", mini-sequence" if self.mini_sequence else ""
        saved = ", attention saved (not recomputed)" if self.recompute_attention == "off" else ""
        return (f"tiled MLP {self.tiled_mlp}, tiled loss {self.tiled_loss}{mini}, {offload}{chunks}{saved} "
                f"({self.reason})")

    def to_dict(self) -> dict:
        return {"tiled_mlp": self.tiled_mlp, "tiled_loss": self.tiled_loss, "mini_sequence": self.mini_sequence,
                "offload_checkpoints": self.offload_checkpoints, "attn_chunks": self.attn_chunks,
                "recompute_attention": self.recompute_attention, "host_mem_budget": self.host_mem_budget,
                "checkpoint_device_budget": self.checkpoint_device_budget, "reason": self.reason}


def choose_memory(config: TrainConfig, hardware: Cluster, shape: ModelShape, params: ParamCounts, sp: int,
                  engine: Engine) -> MemoryChoice:
    """The `auto` memory settings from the memory model, cheapest first.

    Checkpoint offload, mini-sequence and chunked attention (`auto`) are tried together, cheapest first
    (`_memory_options`): nothing, offload (its copies hide under compute), mini-sequence (smaller MLP tiles, norms
    fused into them), both, then attention in 2, 4, ... chunks (each with the same four; chunking re-runs the
    attention block's projections, the dearest technique). The first that fits the
    device and the host wins; when none does, the one with the lowest device peak the host holds. Offload is an
    option only when the sequence is long enough for the copies to hide (MEMO Eq. 1,
    lstune.memory.checkpoint.offload_min_tokens) and never on a CPU, where host and device are one memory;
    chunking goes up to the chunks of `--attn-chunks auto`'s length (the shortest whose host fetch hides,
    lstune.memory.attention_chunks.auto_chunk_tokens). With offload on, the placement's budgets the config leaves
    unset are `placement_budgets`'s. Tiles (`auto`): the fewest (1 = off, then powers of two, up to ALST's counts:
    MLP tiles of `hidden` tokens, loss tiles of ~1 GiB fp32 logits) that keep the predicted device peak within
    AUTO_HEADROOM of the device; ALST's counts when none does. Tiling never changes the numbers, only memory and
    time (an MLP tile recomputes its forward; many small tiles run small kernels), so a tiny model at 4K tokens is
    not cut into 32 tiles. Under --mini-sequence, MST's tiles; on CUDA the loss is Liger's (chunked, and faster
    than plain logits) wherever it applies."""
    options = _memory_options(config, hardware, shape, sp, engine)
    placed = [placed_settings(_resolved(config, chunks, mini), hardware, shape, params, sp, engine, offload)
              for offload, chunks, mini in options]
    peaks = [breakdown(shape, params, s) for s, _ in placed]
    fitting = [i for i, b in enumerate(peaks) if _fits(b, hardware)]
    # When nothing fits, offload and chunks still lower the device peak, but only where the host holds them.
    host_ok = [i for i, b in enumerate(peaks) if b.host_peak * hardware.gpus <= host_capacity(hardware)] or [0]
    pick = fitting[0] if fitting else min(host_ok, key=lambda i: peaks[i].device_peak)
    saving = _saving_pick(config, hardware, shape, params, options, placed, pick)
    moved = saving is not None and saving != pick
    if saving is not None:  # --recompute-attention auto: attention's output kept, checkpoints offloaded if need be
        pick = saving
    (offload, chunks, mini), (base, budgets) = options[pick], placed[pick]
    if saving is not None:
        base = replace(base, save_attention=True)
    mlp, loss, settled = _choose_tiles(_resolved(config, chunks, mini), hardware, shape, params, base)
    reason = (f"the fewest tiles keeping the peak within {AUTO_HEADROOM:.0%} of the device" if settled
              else f"ALST's tiles: the peak is above {AUTO_HEADROOM:.0%} of the device even so")
    if offload and config.memory.offload_checkpoints == "auto":
        reason += ("; checkpoints offloaded: attention's kept output goes to the host with them" if moved
                   else "; checkpoints offloaded: it does not fit the device without")
    if mini and config.memory.mini_sequence == "auto":
        reason += "; mini-sequence: it does not fit the device without"
    if chunks != "off" and config.memory.attn_chunks == "auto":
        reason += f"; attention in {chunks} chunks: " + ("the fewest that fit" if fitting else "the lowest device peak the host holds")
    reason += f"; checkpoint budgets: {budgets}" if budgets else ""
    recompute = "off" if base.save_attention else "on"
    if config.memory.recompute_attention == "auto" and config.memory.checkpointing:
        reason += ("; attention's output saved beside the checkpoints: the extra bytes fit" if base.save_attention
                   else "; attention recomputed in backward: keeping its output would not fit")
    return MemoryChoice(mlp, loss, offload, reason, base.host_mem_budget, base.checkpoint_device_budget, chunks, mini,
                        recompute)


def _saving_pick(config: TrainConfig, hardware: Cluster, shape: ModelShape, params: ParamCounts, options: list,
                 placed: list, pick: int) -> int | None:
    """--recompute-attention auto: the option (of `options`, with their `placed` settings) that keeps attention's
    output (lstune.memory.attention_saved) — the pick itself, or the same attention chunks and mini-sequence with
    checkpoints offloaded (the saved output goes to the host with them) — whose device peak stays within
    AUTO_HEADROOM of the device and whose host peak fits; None (recompute) when none does: at the longest lengths.
    Neither more chunks nor mini-sequence are taken on to save the attention forward: they cost about as much."""
    m = config.memory
    if m.recompute_attention != "auto" or not m.checkpointing:
        return None
    _, chunks, mini = options[pick]
    same = [pick] + [i for i, (_, c, n) in enumerate(options) if c == chunks and n == mini and i != pick]
    for i in same:
        b = breakdown(shape, params, replace(placed[i][0], save_attention=True))
        if _fits(b, hardware) and b.device_peak <= AUTO_HEADROOM * device_capacity(hardware):
            return i
    return None


def placed_settings(config: TrainConfig, hardware: Cluster, shape: ModelShape, params: ParamCounts, sp: int,
                    engine: Engine, offload: bool) -> tuple[Settings, str]:
    """The byte model's settings with checkpoint offload `offload` and the placement's budgets resolved
    (`placement_budgets`), and what the defaults were (empty when none applied)."""
    s = settings(config, hardware, sp, engine, offload)
    host, device, why = placement_budgets(shape, params, s, hardware)
    return replace(s, host_mem_budget=host, checkpoint_device_budget=device), why


def placement_budgets(shape: ModelShape, params: ParamCounts, s: Settings,
                      hardware: Cluster) -> tuple[int | None, int | None, str]:
    """The checkpoint placement's (host budget, device budget, why) for offloaded checkpoints (MEMO, issue 14);
    the user's --host-mem-budget / --checkpoint-device-budget win, and without offload none is added.

    - Host: the node's RAM per local rank less what else the rank keeps there (the process itself, an offloaded
      optimizer or parameters), so a long run gets a placement plan instead of exhausting host memory.
    - Device: only when the host budget cannot hold every checkpoint, the device's headroom — AUTO_HEADROOM of it
      (the margin auto tiles keep) less everything else at the phase where that is highest — so the planner
      recomputes only the layers neither memory holds.
    """
    host, device = s.host_mem_budget, s.checkpoint_device_budget
    if not (s.offload_checkpoints and s.checkpointing):
        return host, device, ""
    why = []
    if host is None:
        elsewhere = breakdown(shape, params, replace(s, host_mem_budget=0, checkpoint_device_budget=None)).host_peak
        host = max(host_capacity(hardware) // hardware.gpus - elsewhere, 0)
        ranks = f" / {hardware.gpus} ranks" if hardware.gpus > 1 else ""
        why.append(f"host {size_text(host)} (the host's usable {size_text(host_capacity(hardware))}{ranks} less "
                   f"{size_text(elsewhere)} else on it)")
    if device is None:
        b = breakdown(shape, params, replace(s, host_mem_budget=host, checkpoint_device_budget=None))
        every = breakdown(shape, params, replace(s, host_mem_budget=None, checkpoint_device_budget=None)).placement
        if b.placement is not None and b.placement.host_bytes() < every.host_bytes():
            target = int(AUTO_HEADROOM * device_capacity(hardware))
            device = max(target - b.device_besides_checkpoints, 0)
            why.append(f"device {size_text(device)} ({AUTO_HEADROOM:.0%} of the device less "
                       f"{size_text(b.device_besides_checkpoints)} else at the peak)")
    return host, device, ", ".join(why)


def _offload_options(config, hardware, shape, sp, engine) -> list[bool]:
    """The checkpoint offload settings `auto` may take, off first (module doc of choose_memory)."""
    m = config.memory
    if m.offload_checkpoints != "auto":
        return [bool(m.offload_checkpoints)]
    if not (m.checkpointing and hardware.on_cuda):
        return [False]
    from lstune.memory.checkpoint import offload_min_tokens

    res = 2 if settings(config, hardware, sp, engine).bf16 else 4
    local = config.optim.micro_batch_size * math.ceil(config.data.seq_len / sp)
    hides = local >= offload_min_tokens(shape.layer_matmul_params(), shape.hidden, shape.q_width, res)
    return [False, True] if hides else [False]


def _chunk_options(config: TrainConfig, hardware: Cluster, shape: ModelShape, sp: int) -> list[str | int]:
    """The --attn-chunks settings `auto` may take: off, then 2, 4, ... up to chunks of the shortest length whose
    copies hide under their attention at this device's rates (attention_chunks.auto_chunk_tokens)."""
    setting = config.memory.attn_chunks
    if setting != "auto":
        return [setting]
    from lstune.memory.attention_chunks import auto_chunk_tokens  # imports torch: only when chunking may be chosen

    d = hardware.device
    tokens = auto_chunk_tokens(shape.q_width, shape.kv_width, pcie_bytes_per_s=d.host_link_gbps * 1e9,
                               flops_per_s=d.attention_tflops * 1e12)
    top = math.ceil(math.ceil(config.data.seq_len / sp) / tokens)
    return ["off"] + [n for n in _ladder(top) if n > 1]


def _memory_options(config, hardware, shape, sp, engine, *,
                    extremes: bool = False) -> list[tuple[bool, str | int, bool]]:
    """(checkpoint offload, attention chunks, mini-sequence) triples `auto` may take, cheapest first
    (choose_memory's doc); `extremes`: only unchunked and the most chunks (enough to tell whether some choice fits:
    more chunks only lower the device peak)."""
    chunks = _chunk_options(config, hardware, shape, sp)
    if extremes:
        chunks = list(dict.fromkeys([chunks[0], chunks[-1]]))
    offloads = _offload_options(config, hardware, shape, sp, engine)
    minis = _mini_sequence_options(config)
    return [(offload, n, mini) for n in chunks for mini in minis for offload in offloads]


def _mini_sequence_options(config: TrainConfig) -> list[bool]:
    """The mini-sequence settings `auto` may take, off first: on needs the MLP tiled (`--tiled-mlp off` keeps it
    off)."""
    m = config.memory
    if m.mini_sequence != "auto":
        return [bool(m.mini_sequence)]
    return [False] if m.tiled_mlp == "off" else [False, True]


def _resolved(config: TrainConfig, chunks: str | int, mini: bool) -> TrainConfig:
    """`config` with the attention chunks and mini-sequence setting of one of `_memory_options`' choices."""
    if config.memory.attn_chunks == chunks and config.memory.mini_sequence is mini:
        return config
    return replace(config, memory=replace(config.memory, attn_chunks=chunks, mini_sequence=mini))


def _fits_some_choice(config, hardware, shape, params, sp, engine) -> bool:
    """Whether the run fits with one of the offload, attention chunk and mini-sequence settings it may take."""
    return any(_fits(breakdown(shape, params, placed_settings(_resolved(config, chunks, mini), hardware, shape, params,
                                                              sp, engine, offload)[0]), hardware)
               for offload, chunks, mini in _memory_options(config, hardware, shape, sp, engine, extremes=True))


def _choose_tiles(config: TrainConfig, hardware: Cluster, shape: ModelShape, params: ParamCounts,
                  base: Settings) -> tuple[str | int, str | int, bool]:
    """(MLP tiles, loss tiles, whether the peak is within the headroom) as choose_memory says."""
    m = config.memory
    mlp_auto = m.tiled_mlp == "auto" and m.mini_sequence is not True
    loss_auto = m.tiled_loss == "auto" and loss_backend(base) == "alst"
    target = AUTO_HEADROOM * device_capacity(hardware)

    def peak(mlp, loss) -> int:
        return breakdown(shape, params, replace(base, tiled_mlp=mlp, tiled_loss=loss)).device_peak

    if not (mlp_auto or loss_auto):
        return m.tiled_mlp, m.tiled_loss, peak(m.tiled_mlp, m.tiled_loss) <= target
    t = base.local_tokens
    mlp_max = math.ceil(t / shape.hidden)
    loss_max = math.ceil(t / max(1, LOSS_TILE_BYTES // (4 * shape.vocab)))

    def fewest(top: int, fits) -> int:
        return next((n for n in _ladder(top) if fits(n)), top)

    loss = fewest(loss_max, lambda n: peak(mlp_max if mlp_auto else m.tiled_mlp, n) <= target) if loss_auto \
        else m.tiled_loss
    mlp = fewest(mlp_max, lambda n: peak(n, loss) <= target) if mlp_auto else m.tiled_mlp
    return _tile_setting(mlp), _tile_setting(loss), peak(mlp, loss) <= target


def _ladder(top: int) -> list[int]:
    """1, 2, 4, ... below `top`, then `top`."""
    return [1 << i for i in range(max(top - 1, 0).bit_length()) if 1 << i < top] + [top]


def _tile_setting(value):
    return "off" if value == 1 else value


def _fits(b: Breakdown, hardware: Cluster) -> bool:
    return b.device_peak <= device_capacity(hardware) and b.host_peak * hardware.gpus <= host_capacity(hardware)


def device_capacity(hardware: Cluster) -> int:
    return hardware.device.device_bytes - reserve_bytes(hardware.device.device_bytes, hardware.on_cuda)


def host_capacity(hardware: Cluster) -> int:
    """A node's RAM less what the OS keeps (memory.host_reserve_bytes): what its ranks can have together."""
    return hardware.host_bytes - host_reserve_bytes(hardware.host_bytes)


def _evaluate(config, hardware, shape, params, sp, engine, model_config) -> Estimate:
    s = settings(config, hardware, sp, engine)
    b = breakdown(shape, params, s)
    chunks = attn_chunk_count(s.attn_chunks, shape, math.ceil(s.seq_len / sp))
    flops = step_flops(model_config, config.data.seq_len, lora=bool(config.model.lora_r),
                       checkpointing=config.memory.checkpointing, lora_r=config.model.lora_r or 16,
                       tiled_mlp=config.memory.tiled_mlp != "off", tiled_loss=loss_backend(s) not in ("off",),
                       extra_layer_forwards=extra_layer_forwards(b.placement),  # issue 14: recomputed checkpoints
                       attn_chunked=chunks > 1, attention_saved_layers=b.attention_saved_layers)
    flops = _scaled(flops, config.optim.micro_batch_size)
    rounds = micro_batches_per_step(config, sp)
    copies = _repeated(step_copies(shape, s, b, flops, hardware, chunks), rounds)
    flops = _scaled(flops, rounds)
    return Estimate(
        model=config.model.name, seq_len=config.data.seq_len, hardware=hardware, engine=engine, sp=sp, breakdown=b,
        params=params, flops=flops, copies=copies,
        step_seconds=step_seconds(flops, hardware, sp, engine, params) + copies.exposed_seconds,
        device_capacity=device_capacity(hardware), host_capacity=host_capacity(hardware), longest_seq_len=0,
        notes=_notes(config, shape, sp),
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


def longest_seq_len(config, hardware, shape, params, sp, engine) -> int:
    """The longest sequence (a multiple of 1024 · SP) whose peaks fit, with everything else unchanged."""
    step = MIN_SEQ * sp

    def fits(n: int) -> bool:
        return _fits_some_choice(_with(config, seq_len=n), hardware, shape, params, sp, engine)

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


def _partial_change(ratio: float) -> dict:
    return {"zero_stage": "3", "offload_optimizer": True, "offload_params": True, "offload_ratio": ratio}


# Changes tried, in order of cost: memory techniques first (no extra hardware), then more sharding/offload. Each is
# the flat config keys it sets, the one it is named for first: the flags a suggestion shows are made from it
# (`change_flags`), so that they are exactly what was estimated.
_OFFLOAD = {"offload_checkpoints": True, "checkpointing": True}
_MINI_OFFLOAD = {"mini_sequence": True, **_OFFLOAD, "tiled_mlp": "auto"}  # mini-sequence tiles the MLP
_CHANGES: list[dict] = [
    {"tiled_loss": "auto"},
    {"tiled_mlp": "auto"},
    {"checkpointing": True},
    _OFFLOAD,
    _MINI_OFFLOAD,
    {"attn_chunks": "auto"},
    {"zero_stage": "3", "offload_optimizer": True},
    {"zero_stage": "3", "offload_optimizer": True, "offload_params": True},
    *(_partial_change(r) for r in AUTO_OFFLOAD_RATIOS),
]


def change_flags(change: dict, config: TrainConfig) -> str:
    """The flags that make `change` to `config`, leaving out the values it has already: given after the user's
    own flags (the last of a repeated flag wins), they give the configuration the suggestion was estimated for.
    Switches as `--x` / `--no-x`, on/off fields (`--checkpointing`) with a value, as lstune.cli.options parses them."""
    current = config.to_dict()
    return " ".join(_flag(key, value) for key, value in change.items() if current.get(key) != value)


def _flag(key: str, value: Any) -> str:
    flag = flag_name(key)
    if isinstance(value, bool):
        if FLAT_FIELDS[key][1].metadata.get("style") == "value":
            return f"{flag} {'on' if value else 'off'}"
        return flag if value else f"--no-{flag[2:]}"
    return f"{flag} {value:g}" if isinstance(value, float) else f"{flag} {value}"


def cheapest_changes(config: TrainConfig, hardware: Cluster, model_config, params: ParamCounts,
                     limit: int = 5) -> list[Suggestion]:
    """Changes that would fit the requested length (each with its peaks and step time), cheapest first; more
    GPUs for sequence parallelism when no single-node change does. On a CPU none that only moves bytes to the host
    (the same RAM) and no more processes (each holds its own weights in the same RAM)."""
    found: list[Suggestion] = []
    current = config.to_dict()
    for change in _changes(config, hardware, model_config, params):
        if all(current.get(k) == v for k, v in change.items()):
            continue
        found += _try(config, hardware, model_config, params, change)
        if sum(s.fits for s in found) >= limit:
            break
    if hardware.on_cuda and not any(s.fits for s in found):
        for gpus in (g for g in (2, 4, 8) if g > hardware.gpus):
            found += _try(config, replace(hardware, gpus=gpus), model_config, params,
                          {"gpus": gpus, "sp": "auto", **_MINI_OFFLOAD})
            if found and found[-1].fits:
                break
    fitting = [s for s in found if s.fits]
    return (fitting or found)[:limit]


def _changes(config: TrainConfig, hardware: Cluster, model_config, params: ParamCounts) -> Iterator[dict]:
    """_CHANGES (on a CPU: less what only moves bytes to the host), then — only when the search gets that far — the
    partial offload `--zero-stage auto` would take beyond AUTO_OFFLOAD_RATIOS (`partial_offload_ratios`), when one
    fits: the first ratio whose byte model fits (one byte model a ratio, not an estimate)."""
    if not hardware.on_cuda:
        on_cpu = [{k: v for k, v in c.items() if k != "offload_checkpoints"} for c in _CHANGES
                  if not (c.get("offload_optimizer") or c.get("offload_params"))]
        yield from (c for i, c in enumerate(on_cpu) if c not in on_cpu[:i])
        return
    yield from _CHANGES
    fine = partial_offload_ratios()[len(AUTO_OFFLOAD_RATIOS):]
    try:  # the ratio changes neither the config's problems nor the SP degree: checked once
        changed = _with(config, **_partial_change(fine[0]))
        if changed.problems():
            return
        sp = resolve_sp(changed, hardware, model_config)
    except ConfigError:
        return
    shape = ModelShape.from_config(model_config)
    for ratio in fine:
        change = _partial_change(ratio)
        engine = Engine("deepspeed", 3, True, True, ratio)
        if _fits_some_choice(_with(config, **change), hardware, shape, params, sp, engine):
            yield change
            return


def _try(config, hardware, model_config, params, change) -> list[Suggestion]:
    """`change` estimated on `hardware` (whose `gpus` is the change's, if it has one), as a Suggestion."""
    try:
        changed = _with(config, **change)
        if changed.problems():
            return []
        e = estimate(changed, hardware, model_config=model_config, params=params, suggest=False, reach=False)
    except ConfigError:
        return []
    return [Suggestion(change_flags(change, config), e.device_peak_bytes, e.host_peak_bytes, e.step_seconds,
                       e.fits)]


def _notes(config: TrainConfig, shape: ModelShape, sp: int) -> list[str]:
    notes = []
    local = math.ceil(config.data.seq_len / sp)
    if local * shape.hidden >= 2**31:
        notes.append(f"{local:,} local tokens × hidden {shape.hidden} reach 2^31 elements: kernels outside the tiles "
                     f"may overflow int32; keep the local sequence below {2**31 // shape.hidden:,} (raise SP).")
    return notes


__all__ = ["Estimate", "Suggestion", "MemoryChoice", "choose_memory", "estimate", "StepFlops", "step_flops", "Cluster", "choose_engine",
           "engine_candidates", "partial_offload_ratios", "longest_seq_len", "longest_reach", "cheapest_changes"]
