"""Recipe (YAML) + flags → one validated TrainConfig, reporting every problem at once.

Precedence: flags > recipe > defaults. Nothing heavy is imported here: this runs before any model or
data is touched, so a typo costs a second, not a model load.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any, Callable

from lstune.config.schema import FLAT_FIELDS, TrainConfig, flag_name
from lstune.errors import ConfigError


def read_recipe(path: str | Path) -> dict[str, Any]:
    """The mapping in a YAML recipe; ConfigError when missing, unreadable or not a mapping."""
    import yaml

    path = Path(path)
    if not path.is_file():
        raise ConfigError([f"--config {str(path)!r} does not exist; give the path of a YAML recipe (see recipes/)."])
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ConfigError([f"--config {str(path)!r} is not valid YAML: {exc}"]) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError([f"--config {str(path)!r} must be a mapping of keys to values, e.g. `seq_len: 32k`."])
    return data


def build_config(
    recipe: dict[str, Any] | None = None,
    flags: dict[str, Any] | None = None,
    *,
    recipe_name: str = "the recipe",
    checks: Callable[[TrainConfig], list[str]] | None = None,
) -> TrainConfig:
    """Merge recipe values and flags (flat keys; None = not given) into a TrainConfig; raise ConfigError
    listing every invalid or unknown key, every section's problems, and what `checks` finds (e.g. a
    missing data path)."""
    problems: list[str] = []
    values: dict[str, Any] = {}

    for key, raw in (recipe or {}).items():
        name = str(key).replace("-", "_")
        if name not in FLAT_FIELDS:
            problems.append(_unknown_key(str(key), recipe_name))
            continue
        values[name] = (raw, f"{key} in {recipe_name}")
    for name, raw in (flags or {}).items():
        if raw is not None:
            values[name] = (raw, flag_name(name))

    parsed: dict[str, Any] = {}
    for name, (raw, where) in values.items():
        if raw is None:
            parsed[name] = None
            continue
        try:
            parsed[name] = FLAT_FIELDS[name][1].metadata["parser"](raw)
        except ValueError as exc:
            problems.append(f"{where} {str(raw)!r} {exc}.")

    config = TrainConfig.from_flat(parsed)
    problems.extend(config.problems())
    if checks is not None:
        problems.extend(checks(config))
    if problems:
        raise ConfigError(problems)
    return config


# Names users bring from other trainers, mapped to ours for the "did you mean" hint.
_ALIASES = {
    "learning_rate": "lr",
    "batch_size": "micro_batch_size",
    "per_device_train_batch_size": "micro_batch_size",
    "gradient_accumulation_steps": "grad_accum",
    "max_seq_len": "seq_len",
    "sequence_length": "seq_len",
    "max_length": "seq_len",
    "model_name_or_path": "model",
    "dataset": "data",
    "save_steps": "save_every",
    "num_train_epochs": "epochs",
    "warmup": "warmup_steps",
    "lr_scheduler_type": "schedule",
}


def _unknown_key(key: str, recipe_name: str) -> str:
    name = key.replace("-", "_")
    candidates = list(FLAT_FIELDS) + list(_ALIASES)
    close = difflib.get_close_matches(name, candidates, n=1, cutoff=0.7)
    close = [_ALIASES.get(c, c) for c in close]
    hint = f" Did you mean '{close[0]}'?" if close else " See `lstune train --help` for the keys."
    return f"unknown key '{key}' in {recipe_name}.{hint}"
