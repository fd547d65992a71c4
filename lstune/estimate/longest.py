"""The longest sequence a configuration fits (a binary search over the byte model, each length with the memory
choices `auto` may take there: lstune.estimate.choice.fits_some_choice)."""

from __future__ import annotations

from lstune.config.schema import TrainConfig
from lstune.estimate.choice import engine_candidates, fits_some_choice, reach_candidates
from lstune.estimate.hardware import Cluster
from lstune.estimate.memory import Engine
from lstune.estimate.settings import MIN_SEQ, with_flat
from lstune.estimate.shapes import ModelShape, ParamCounts


def longest_reach(config: TrainConfig, hardware: Cluster, shape: ModelShape, params: ParamCounts, sp: int,
                  chosen: Engine | None = None) -> int:
    """The longest sequence the configuration fits with the engine `--zero-stage auto` would pick at that length:
    the most of `longest_seq_len` over the engines it may pick (at a longer sequence it may pick a more offloaded
    engine than at this one — Llama-3.1-8B LoRA on one H100: 730K with AdamW on the device, 886K with ZeRO-3 and
    the parameters on the host), of the partial offloads AUTO_OFFLOAD_RATIOS' and `chosen`'s (the engine picked at
    the requested length; each search costs ~20 byte models, too many to make for all 31 ratios)."""
    engines = reach_candidates(engine_candidates(config, hardware))
    if chosen is not None and chosen not in engines:
        engines.append(chosen)
    return max(longest_seq_len(config, hardware, shape, params, sp, e) for e in engines)


def longest_seq_len(config, hardware, shape, params, sp, engine) -> int:
    """The longest sequence (a multiple of 1024 · SP) whose peaks fit, with everything else unchanged."""
    step = MIN_SEQ * sp

    def fits(n: int) -> bool:
        return fits_some_choice(with_flat(config, seq_len=n), hardware, shape, params, sp, engine)

    if not fits(step):
        return 0
    low, high = 1, 2
    while fits(high * step) and high < 2**24:
        low, high = high, high * 2
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid * step) else (low, mid)
    return low * step
