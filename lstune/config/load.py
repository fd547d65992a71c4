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


# A recipe is a few dozen keys. These bounds keep a hostile one (a "billion laughs" of nested aliases, a
# huge or deeply nested document) from taking minutes or gigabytes before it is refused.
MAX_RECIPE_BYTES = 1024 * 1024
MAX_RECIPE_NODES = 10_000  # YAML nodes after alias expansion


def read_recipe(path: str | Path) -> dict[str, Any]:
    """The mapping in a YAML recipe; ConfigError when missing, unreadable, too large or not a mapping."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError([f"--config {str(path)!r} does not exist; give the path of a YAML recipe (see recipes/)."])
    where = f"--config {str(path)!r}"
    if path.stat().st_size > MAX_RECIPE_BYTES:
        raise ConfigError([f"{where} is {path.stat().st_size:,} bytes; a recipe is at most {MAX_RECIPE_BYTES:,}."])
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError([f"{where} is not UTF-8 text (byte {exc.start} is {exc.object[exc.start]:#04x}); "
                           "save the recipe as UTF-8."]) from None
    data = _load_yaml(text, where)
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError([f"--config {str(path)!r} must be a mapping of keys to values, e.g. `seq_len: 32k`."])
    return data


def _load_yaml(text: str, where: str) -> Any:
    """yaml.safe_load, refusing documents whose alias-expanded size passes MAX_RECIPE_NODES."""
    import yaml

    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is not None and _expanded_size(node, {}) > MAX_RECIPE_NODES:
            raise ConfigError([f"{where} expands to more than {MAX_RECIPE_NODES:,} YAML values (nested aliases?); "
                               "a recipe is a flat mapping of settings."])
        return loader.construct_document(node) if node is not None else None
    except yaml.YAMLError as exc:
        raise ConfigError([f"{where} is not valid YAML: {exc}"]) from None
    except RecursionError:
        raise ConfigError([f"{where} is nested too deeply; a recipe is a flat mapping of settings."]) from None
    finally:
        loader.dispose()


def _expanded_size(node: Any, sizes: dict[int, int]) -> int:
    """Nodes in the document with every alias expanded, computed once per distinct node (aliases share
    node objects), so a billion-laughs document is measured in microseconds, not expanded."""
    import yaml

    key = id(node)
    if key in sizes:
        return sizes[key]
    sizes[key] = MAX_RECIPE_NODES + 1  # a node reached again while measuring it: a cycle, refused as too large
    if isinstance(node, yaml.SequenceNode):
        total = 1 + sum(_expanded_size(child, sizes) for child in node.value)
    elif isinstance(node, yaml.MappingNode):
        total = 1 + sum(_expanded_size(k, sizes) + _expanded_size(v, sizes) for k, v in node.value)
    else:
        total = 1
    sizes[key] = min(total, MAX_RECIPE_NODES + 1)
    return sizes[key]


def show_value(raw: Any) -> str:
    """A value for an error message: quoted and cut to 60 characters; never the text of a container,
    which may be huge (the message says what kind it is instead)."""
    if isinstance(raw, dict):
        return "(a mapping)"
    if isinstance(raw, (list, tuple, set)):
        return "(a list)"
    text = repr(str(raw))
    return text if len(text) <= 60 else text[:57] + "...'"


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
            problems.append(_unknown_key(show_value(key).strip("'"), recipe_name))
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
        f = FLAT_FIELDS[name][1]
        if isinstance(raw, (dict, list, tuple, set)) and not f.metadata.get("accepts_list"):
            kind = "mapping" if isinstance(raw, dict) else "list"
            problems.append(f"{where} is a {kind}, but {name} takes a single value, e.g. {name}: {_example(f)}.")
            continue
        try:
            parsed[name] = f.metadata["parser"](raw)
        except ValueError as exc:
            problems.append(f"{where} {show_value(raw)} {exc}.")

    config = TrainConfig.from_flat(parsed)
    problems.extend(config.problems())
    if checks is not None:
        problems.extend(checks(config))
    if problems:
        raise ConfigError(problems)
    return config


def _example(f) -> str:
    return "VALUE" if f.default is None else str(f.default).lower()


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
