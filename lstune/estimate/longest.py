"""The longest sequence a configuration fits: per kind of memory choice `auto` may take (offload, attention chunks,
mini-sequence), a search over the byte model from the first length that kind is open, and the most of theirs
(issue 32: one search over every choice at once stopped short where a choice opens only at longer lengths)."""

from __future__ import annotations

from dataclasses import replace

from lstune.config.schema import TrainConfig
from lstune.estimate.choice import (AUTO_OFFLOAD_RATIOS, chunk_options, engine_candidates, mini_sequence_options,
                                    offload_options, placed_settings, reach_candidates, resolved)
from lstune.estimate.hardware import Cluster
from lstune.estimate.memory import Engine, Settings, breakdown
from lstune.estimate.settings import MIN_SEQ, fits
from lstune.estimate.shapes import ModelShape, ParamCounts


def longest_reach(config: TrainConfig, hardware: Cluster, shape: ModelShape, params: ParamCounts, sp: int,
                  chosen: Engine | None = None) -> int:
    """The longest sequence the configuration fits with the engine `--zero-stage auto` would pick at that length:
    the most of `longest_seq_len` over the engines it may pick (at a longer sequence it may pick a more offloaded
    engine than at this one — Llama-3.1-8B LoRA on one H100: 730K with AdamW on the device, 886K with ZeRO-3 and
    the parameters on the host), of the partial offloads AUTO_OFFLOAD_RATIOS' and `chosen`'s (the engine picked at
    the requested length; each search costs ~20 byte models, too many to make for all 31 ratios) — and then the
    fine ratios beside the best partial one (`_finer_ratios`): a ratio's longest rises with it while the device
    binds and falls while the host does, so the best lies between its coarse neighbours."""
    candidates = engine_candidates(config, hardware)
    engines = reach_candidates(candidates)
    if chosen is not None and chosen not in engines:
        engines.append(chosen)
    reach = {e: longest_seq_len(config, hardware, shape, params, sp, e) for e in engines}
    best = max(reach, key=reach.get)
    for e in _finer_ratios(best, candidates):
        if e not in reach:
            reach[e] = longest_seq_len(config, hardware, shape, params, sp, e)
    return max(reach.values())


def _finer_ratios(best: Engine, candidates: list[Engine]) -> list[Engine]:
    """The partial offloads among `candidates` whose ratio lies strictly between the coarse ratios around `best`'s
    (AUTO_OFFLOAD_RATIOS and the whole offload, 1), when `best` is a partial offload or the whole one."""
    if not (best.offload_optimizer and best.zero_stage == 3):
        return []
    coarse = sorted({1.0, *AUTO_OFFLOAD_RATIOS, 0.0})
    if best.offload_ratio not in coarse:
        return []
    i = coarse.index(best.offload_ratio)
    low, high = coarse[max(i - 1, 0)], coarse[min(i + 1, len(coarse) - 1)]
    return [e for e in candidates if e.offload_params == best.offload_params and e.offload_optimizer
            and low < e.offload_ratio < high and e.offload_ratio not in coarse]


def longest_seq_len(config, hardware, shape, params, sp, engine) -> int:
    """The longest sequence (a multiple of 1024 · SP) whose peaks fit with `engine`, everything else unchanged but
    what `auto` chooses at each length (checkpoint offload, attention chunks, mini-sequence). One bisection over
    all lengths could stop short: `auto` may take a choice only from some length on (offload once its copies hide,
    more chunks as the sequence grows), so "fits" is not monotone in the length. With the kind of choice held fixed
    (`_choice_kinds`) it nearly is, from the first length that kind is open (`_longest_of_kind`, which also tries the
    lengths just past its last fit: the tiles' sawtooth): the longest is the most of theirs."""
    return max((_longest_of_kind(config, hardware, shape, params, sp, engine, kind)
                for kind in _choice_kinds(config)), default=0)


def _choice_kinds(config: TrainConfig) -> list[tuple[bool, str, bool]]:
    """(checkpoint offload, "off" or "most" chunks, mini-sequence) kinds of choice `auto` may make at some length:
    among chunk counts the most is enough (more chunks only lower the device peak and keep one margin)."""
    m = config.memory
    offloads = [False, True] if m.offload_checkpoints == "auto" else [bool(m.offload_checkpoints)]
    chunks = ["off", "most"] if m.attn_chunks == "auto" else [m.attn_chunks]
    return [(offload, n, mini) for offload in offloads for n in chunks for mini in mini_sequence_options(config)]


def _longest_of_kind(config, hardware, shape, params, sp, engine, kind) -> int:
    """The longest length one kind of choice fits: open from its first length on (a bisection for that), then
    fitting up to its longest (another; the peaks grow with the length but for the sawtooth of the tiles `auto`
    resolves at each length, so the UPWARD_STEPS lengths past it are tried too, and the search goes on from any that
    fits)."""
    step = MIN_SEQ * sp
    top = 2**24

    def settings_at(n: int):
        return _kind_settings(_at_length(config, n), hardware, shape, params, sp, engine, kind)

    def fits_at(n: int) -> bool:
        s = settings_at(n * step)
        return s is not None and fits(breakdown(shape, params, s), hardware)

    first = _first(lambda n: settings_at(n * step) is not None, top)
    if first is None or not fits_at(first):
        return 0
    low = first
    while True:
        low = _last_fitting(fits_at, low, top)
        again = next((n for n in range(low + 1, min(low + UPWARD_STEPS, top) + 1) if fits_at(n)), None)
        if again is None:
            return low * step
        low = again


# Lengths tried past a search's last fit: the tiles `auto` resolves at each length (a tile's tokens ⌈t / tiles⌉,
# the tile counts themselves) make the peaks a sawtooth in the length, so a length a few steps on can fit again
# (Llama-3.2-1B LoRA, 5 GiB device, 3 attention chunks: 46,080 fits, 47,104 not, 48,128 again).
UPWARD_STEPS = 8


def _last_fitting(fits_at, low: int, top: int) -> int:
    """From a fitting `low`: double while it fits, then bisect to the last fitting n before the first failure."""
    high = low * 2
    while high < top and fits_at(high):
        low, high = high, high * 2
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if fits_at(mid) else (low, mid)
    return low


def _first(is_open, top: int) -> int | None:
    """The smallest n in 1..top with is_open(n), for an is_open that stays true once true (None when never)."""
    high = 1
    while not is_open(high):
        if high >= top:
            return None
        high *= 2
    low = high // 2  # closed (or 0)
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (low, mid) if is_open(mid) else (mid, high)
    return high


def _kind_settings(config, hardware, shape, params, sp, engine, kind) -> Settings | None:
    """The byte model's settings of `kind` at `config`'s length, or None where `auto` cannot take it there."""
    offload, chunk_kind, mini = kind
    if offload not in offload_options(config, hardware, shape, sp, engine):
        return None
    chunks = chunk_kind
    if chunk_kind == "most":
        chunks = chunk_options(config, hardware, shape, sp)[-1]
        if chunks == "off":
            return None
    return placed_settings(resolved(config, chunks, mini), hardware, shape, params, sp, engine, offload)[0]


def _at_length(config: TrainConfig, n: int) -> TrainConfig:
    return replace(config, data=replace(config.data, seq_len=n))
