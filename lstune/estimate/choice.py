"""The planner's choices: the engine `--zero-stage auto` takes (`choose_engine`, the first of `engine_candidates`
whose predicted peaks fit) and what the `auto` memory settings resolve to (`choose_memory` → `MemoryChoice`, the
config's memory section with nothing left to resolve, and why). One byte model (lstune.estimate.memory) answers
every "does it fit", so a choice never disagrees with the estimate shown for it."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from lstune.config.schema import MemorySection, TrainConfig, zero_problems
from lstune.errors import ConfigError
from lstune.estimate.hardware import Cluster
from lstune.estimate.memory import LOSS_TILE_BYTES, Engine, Settings, breakdown, loss_backend, size_text
from lstune.estimate.settings import (AUTO_HEADROOM, device_capacity, device_target, fits, host_capacity, host_limit,
                                      ladder, settings)
from lstune.estimate.shapes import ModelShape, ParamCounts


AUTO_OFFLOAD_RATIOS = (0.75, 0.5, 0.25)  # the partial offloads `--zero-stage auto` tries first


def partial_offload_ratios() -> list[float]:
    """The --offload-ratio values `--zero-stage auto` tries, in order: AUTO_OFFLOAD_RATIOS, then every other k / n
    of the n optimizer sub-groups lstune cuts a rank's parameters into (the resolution DeepSpeed honours,
    lstune.parallel.engine_ds.PARTIAL_SUB_GROUPS), most on the host first. The fine ones matter where the fitting
    window is narrow: Llama-3.1-8B's full fine-tune at 16K on an H100 with a 120 GiB host fits, within the margin,
    at 15/32 (predicted: device 70.8 GiB, host 110.2 GiB)."""
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


def reach_candidates(candidates: list[Engine]) -> list[Engine]:
    """`candidates` less the fine partial offloads (`partial_offload_ratios`), unless only those are left."""
    coarse = [e for e in candidates if e.offload_ratio >= 1 or e.offload_ratio in AUTO_OFFLOAD_RATIOS]
    return coarse or list(candidates)


@dataclass(frozen=True)
class MemoryChoice:
    """The memory settings one run applies — the config's own `MemorySection` with the estimate's `auto` resolved
    (`tiled_mlp` / `tiled_loss`: "off", a tile count, or "auto" where a policy decides per batch: Liger's chunks on
    CUDA, MST's tiles with --mini-sequence; `offload_checkpoints`, `mini_sequence`: on or off; `attn_chunks`: "off"
    or a chunk count (FPDT); the checkpoint placement's budgets, `placement_budgets`) — and why. Its fields read
    through to the section (`choice.tiled_mlp`): one settings type, not a copy of it."""

    memory: MemorySection
    reason: str = ""

    def __getattr__(self, name: str):
        if name == "memory" or name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.memory, name)

    def applied_to(self, config: TrainConfig) -> TrainConfig:
        """`config` with these settings as its memory section (what lstune train prepares the model with)."""
        return replace(config, memory=self.memory)

    def describe(self) -> str:
        m = self.memory
        offload = "offloaded checkpoints" if m.offload_checkpoints else "no checkpoint offload"
        chunks = "" if m.attn_chunks == "off" else f", attention in {m.attn_chunks} chunks"
        mini = ", mini-sequence" if m.mini_sequence else ""
        kept = ", attention's output kept (not recomputed)" if m.recompute_attention == "off" else ""
        return f"tiled MLP {m.tiled_mlp}, tiled loss {m.tiled_loss}{mini}, {offload}{chunks}{kept} ({self.reason})"

    def to_dict(self) -> dict:
        m = self.memory
        return {"tiled_mlp": m.tiled_mlp, "tiled_loss": m.tiled_loss, "mini_sequence": m.mini_sequence,
                "offload_checkpoints": m.offload_checkpoints, "attn_chunks": m.attn_chunks,
                "recompute_attention": m.recompute_attention, "host_mem_budget": m.host_mem_budget,
                "checkpoint_device_budget": m.checkpoint_device_budget, "reason": self.reason}


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
    placed = [placed_settings(resolved(config, chunks, mini), hardware, shape, params, sp, engine, offload)
              for offload, chunks, mini in options]
    peaks = [breakdown(shape, params, s) for s, _ in placed]
    fitting = [i for i, b in enumerate(peaks) if fits(b, hardware)]
    # When nothing fits, offload and chunks still lower the device peak, but only where the host holds them.
    host_ok = [i for i, b in enumerate(peaks) if b.host_peak * hardware.gpus <= host_limit(hardware)] or [0]
    pick = fitting[0] if fitting else min(host_ok, key=lambda i: peaks[i].device_peak)
    saving = _saving_pick(config, hardware, shape, params, options, placed, pick)
    moved = saving is not None and saving != pick
    if saving is not None:  # --recompute-attention auto: attention's output kept, checkpoints offloaded if need be
        pick = saving
    (offload, chunks, mini), (base, budgets) = options[pick], placed[pick]
    if saving is not None:
        base = replace(base, save_attention=True)
    mlp, loss, settled = _choose_tiles(resolved(config, chunks, mini), hardware, shape, params, base)
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
    if config.memory.recompute_attention == "auto" and config.memory.checkpointing:
        reason += ("; attention's output kept beside the checkpoints: the extra bytes fit" if base.save_attention
                   else "; attention recomputed in backward: keeping its output would not fit")
    memory = replace(config.memory, tiled_mlp=mlp, tiled_loss=loss, offload_checkpoints=offload, attn_chunks=chunks,
                     mini_sequence=mini, host_mem_budget=base.host_mem_budget,
                     checkpoint_device_budget=base.checkpoint_device_budget,
                     recompute_attention="off" if base.save_attention else "on")
    return MemoryChoice(memory, reason)


def _saving_pick(config: TrainConfig, hardware: Cluster, shape: ModelShape, params: ParamCounts, options: list,
                 placed: list, pick: int) -> int | None:
    """--recompute-attention auto: the option (of `options`, with their `placed` settings) that keeps attention's
    output (lstune.memory.attention_saved) — the pick itself, or the same attention chunks and mini-sequence with
    checkpoints offloaded (the kept output goes to the host with them) — whose device peak stays within
    the device target auto tiles keep (`device_target`: AUTO_HEADROOM, or the margin where it asks more) and whose
    peaks fit with the margin (`fits`); None (recompute) when none does: at the longest lengths.
    Neither more chunks nor mini-sequence are taken on to keep the attention forward: they cost about as much."""
    m = config.memory
    if m.recompute_attention != "auto" or not m.checkpointing or shape.sinks:  # sinks: recomputed (attention_saved)
        return None
    _, chunks, mini = options[pick]
    same = [pick] + [i for i, (_, c, n) in enumerate(options) if c == chunks and n == mini and i != pick]
    for i in same:
        b = breakdown(shape, params, replace(placed[i][0], save_attention=True))
        if fits(b, hardware) and b.device_peak <= device_target(hardware, b):  # the margin, as auto tiles keep it
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
        host = max(host_limit(hardware) // hardware.gpus - elsewhere, 0)
        ranks = f" / {hardware.gpus} ranks" if hardware.gpus > 1 else ""
        why.append(f"host {size_text(host)} (the host's usable {size_text(host_limit(hardware))} within the margin"
                   f"{ranks} less "
                   f"{size_text(elsewhere)} else on it)")
    if device is None:
        b = breakdown(shape, params, replace(s, host_mem_budget=host, checkpoint_device_budget=None))
        every = breakdown(shape, params, replace(s, host_mem_budget=None, checkpoint_device_budget=None)).placement
        if b.placement is not None and b.placement.host_bytes() < every.host_bytes():
            target = device_target(hardware, b)
            device = max(target - b.device_besides_checkpoints, 0)
            why.append(f"device {size_text(device)} ({AUTO_HEADROOM:.0%} of the device less "
                       f"{size_text(b.device_besides_checkpoints)} else at the peak)")
    return host, device, ", ".join(why)


def offload_options(config, hardware, shape, sp, engine) -> list[bool]:
    """The checkpoint offload settings `auto` may take, off first (module doc of choose_memory)."""
    m = config.memory
    if m.offload_checkpoints != "auto":
        return [bool(m.offload_checkpoints)]
    if not (m.checkpointing and hardware.on_cuda):
        return [False]
    from lstune.memory.offload_math import offload_min_tokens

    res = 2 if settings(config, hardware, sp, engine).bf16 else 4
    local = config.optim.micro_batch_size * math.ceil(config.data.seq_len / sp)
    hides = local >= offload_min_tokens(shape.layer_matmul_params(), shape.hidden, shape.q_width, res)
    return [False, True] if hides else [False]


def chunk_options(config: TrainConfig, hardware: Cluster, shape: ModelShape, sp: int) -> list[str | int]:
    """The --attn-chunks settings `auto` may take: off, then 2, 4, ... up to chunks of the shortest length whose
    copies hide under their attention at this device's rates (attention_chunks.auto_chunk_tokens)."""
    setting = config.memory.attn_chunks
    if setting != "auto":
        return [setting]
    from lstune.memory.offload_math import auto_chunk_tokens

    d = hardware.device
    tokens = auto_chunk_tokens(shape.q_width, shape.kv_width, pcie_bytes_per_s=d.host_link_gbps * 1e9,
                               flops_per_s=d.attention_tflops * 1e12)
    top = math.ceil(math.ceil(config.data.seq_len / sp) / tokens)
    return ["off"] + [n for n in ladder(top) if n > 1]


def _memory_options(config, hardware, shape, sp, engine, *,
                    extremes: bool = False) -> list[tuple[bool, str | int, bool]]:
    """(checkpoint offload, attention chunks, mini-sequence) triples `auto` may take, cheapest first
    (choose_memory's doc); `extremes`: only unchunked and the most chunks (enough to tell whether some choice fits:
    more chunks only lower the device peak)."""
    chunks = chunk_options(config, hardware, shape, sp)
    if extremes:
        chunks = list(dict.fromkeys([chunks[0], chunks[-1]]))
    offloads = offload_options(config, hardware, shape, sp, engine)
    minis = mini_sequence_options(config)
    return [(offload, n, mini) for n in chunks for mini in minis for offload in offloads]


def mini_sequence_options(config: TrainConfig) -> list[bool]:
    """The mini-sequence settings `auto` may take, off first: on needs the MLP tiled (`--tiled-mlp off` keeps it
    off)."""
    m = config.memory
    if m.mini_sequence != "auto":
        return [bool(m.mini_sequence)]
    return [False] if m.tiled_mlp == "off" else [False, True]


def resolved(config: TrainConfig, chunks: str | int, mini: bool) -> TrainConfig:
    """`config` with the attention chunks and mini-sequence setting of one of `_memory_options`' choices."""
    if config.memory.attn_chunks == chunks and config.memory.mini_sequence is mini:
        return config
    return replace(config, memory=replace(config.memory, attn_chunks=chunks, mini_sequence=mini))


def fits_some_choice(config, hardware, shape, params, sp, engine) -> bool:
    """Whether the run fits with one of the offload, attention chunk and mini-sequence settings it may take."""
    return any(fits(breakdown(shape, params, placed_settings(resolved(config, chunks, mini), hardware, shape, params,
                                                              sp, engine, offload)[0]), hardware)
               for offload, chunks, mini in _memory_options(config, hardware, shape, sp, engine, extremes=True))


def _choose_tiles(config: TrainConfig, hardware: Cluster, shape: ModelShape, params: ParamCounts,
                  base: Settings) -> tuple[str | int, str | int, bool]:
    """(MLP tiles, loss tiles, whether the peak is within the headroom) as choose_memory says."""
    m = config.memory
    mlp_auto = m.tiled_mlp == "auto" and m.mini_sequence is not True and not base.metp_mlp
    loss_auto = m.tiled_loss == "auto" and loss_backend(base) == "alst"
    def peak(mlp, loss) -> int:
        return breakdown(shape, params, replace(base, tiled_mlp=mlp, tiled_loss=loss)).device_peak

    target = device_target(hardware, breakdown(shape, params, base))

    if not (mlp_auto or loss_auto):
        return m.tiled_mlp, m.tiled_loss, peak(m.tiled_mlp, m.tiled_loss) <= target
    t = base.local_tokens
    mlp_max = math.ceil(t / shape.hidden)
    loss_max = math.ceil(t / max(1, LOSS_TILE_BYTES // (4 * shape.vocab)))

    def fewest(top: int, fits) -> int:
        return next((n for n in ladder(top) if fits(n)), top)

    loss = fewest(loss_max, lambda n: peak(mlp_max if mlp_auto else m.tiled_mlp, n) <= target) if loss_auto \
        else m.tiled_loss
    mlp = fewest(mlp_max, lambda n: peak(n, loss) <= target) if mlp_auto else m.tiled_mlp
    return _tile_setting(mlp), _tile_setting(loss), peak(mlp, loss) <= target


def _tile_setting(value):
    return "off" if value == 1 else value
