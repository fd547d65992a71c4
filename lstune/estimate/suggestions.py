"""The cheapest changes that would make a configuration fit, as the flags that make them (`cheapest_changes`), each
estimated exactly as given."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Iterator

from lstune.config.schema import FLAT_FIELDS, TrainConfig, flag_name
from lstune.errors import ConfigError
from lstune.estimate.choice import AUTO_OFFLOAD_RATIOS, fits_some_choice, partial_offload_ratios
from lstune.estimate.hardware import Cluster
from lstune.estimate.memory import Engine
from lstune.estimate.prediction import predict
from lstune.estimate.settings import resolve_sp, with_flat
from lstune.estimate.shapes import ModelShape, ParamCounts


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


def partial_change(ratio: float) -> dict:
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
    *(partial_change(r) for r in AUTO_OFFLOAD_RATIOS),
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
        changed = with_flat(config, **partial_change(fine[0]))
        if changed.problems():
            return
        sp = resolve_sp(changed, hardware, model_config)
    except ConfigError:
        return
    shape = ModelShape.from_config(model_config)
    for ratio in fine:
        change = partial_change(ratio)
        engine = Engine("deepspeed", 3, True, True, ratio)
        if fits_some_choice(with_flat(config, **change), hardware, shape, params, sp, engine):
            yield change
            return


def _try(config, hardware, model_config, params, change) -> list[Suggestion]:
    """`change` estimated on `hardware` (whose `gpus` is the change's, if it has one), as a Suggestion."""
    try:
        changed = with_flat(config, **change)
        if changed.problems():
            return []
        e = predict(changed, hardware, model_config=model_config, params=params, reach=False)
    except ConfigError:
        return []
    return [Suggestion(change_flags(change, config), e.device_peak_bytes, e.host_peak_bytes, e.step_seconds,
                       e.fits)]
