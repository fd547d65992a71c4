"""Recipe (YAML) + flags → one validated TrainConfig, reporting every problem at once.

Precedence: flags > recipe > defaults. Nothing heavy is imported here: this runs before any model or
data is touched, so a typo costs a second, not a model load.
"""

from __future__ import annotations

import difflib
import functools
import re
from pathlib import Path
from typing import Any, Callable

from lstune.config.schema import FLAT_FIELDS, TrainConfig, flag_name
from lstune.errors import ConfigError
from lstune.untrusted import path_kind


# A recipe is a few dozen keys. These bounds keep a hostile one (a "billion laughs" of nested aliases, a
# huge or deeply nested document) from taking minutes or gigabytes before it is refused.
MAX_RECIPE_BYTES = 1024 * 1024
MAX_RECIPE_NODES = 10_000  # YAML nodes after alias expansion


# The recipes shipped with lstune (package data; in a clone, lstune/recipes links to the repository's recipes/).
RECIPES_DIR = Path(__file__).resolve().parents[1] / "recipes"


def shipped_recipes() -> dict[str, Path]:
    """Name (`tiny-llama/4k-cpu-demo`) -> file, for every recipe shipped with lstune, sorted by name."""
    files = sorted(RECIPES_DIR.glob("*/*.yaml")) if RECIPES_DIR.is_dir() else []
    return {f"{p.parent.name}/{p.stem}": p for p in files}


def find_recipe(given: str | Path) -> Path:
    """The recipe file `--config` names: a path when one exists there, else a shipped recipe by name, with or without
    `.yaml` and a leading `recipes/` (so the README's `--config recipes/...` works from any folder)."""
    path = Path(given)
    if path.exists() or path.is_absolute():
        return path
    name = str(given).replace("\\", "/").removeprefix("./").removeprefix("recipes/").removesuffix(".yaml")
    return shipped_recipes().get(name, path)


def read_recipe(path: str | Path) -> dict[str, Any]:
    """The mapping in a YAML recipe (a path, or a shipped recipe's name: `find_recipe`); ConfigError when missing,
    unreadable, too large or not a mapping."""
    where = f"--config {str(path)!r}"
    path = find_recipe(path)
    if path.is_dir():
        raise ConfigError([f"{where} is a folder; give the path of a YAML recipe file{_recipes_in(path)}."])
    if not path.is_file():
        what = path_kind(path)
        said = "does not exist" if what == "nothing" else f"is {what}, not a file"
        raise ConfigError([f"{where} {said}; give the path of a YAML recipe, or the name of one shipped with lstune "
                           "(`lstune recipes` lists them)."])
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


def _recipes_in(folder: Path) -> str:
    """' in it, e.g. a.yaml, b.yaml' (at most 5), or ' (see recipes/)' when it holds none."""
    names = sorted(p.name for p in folder.glob("*.y*ml") if p.is_file())[:5]
    return f" in it, e.g. {', '.join(names)}" if names else " (see recipes/)"


def _load_yaml(text: str, where: str) -> Any:
    """yaml.safe_load, refusing documents whose alias-expanded size passes MAX_RECIPE_NODES and mappings that
    give a key twice (PyYAML keeps the last silently: the first value would be ignored without a word)."""
    import yaml

    loader = _recipe_loader()(text)
    try:
        node = loader.get_single_node()
        if node is not None and _expanded_size(node, {}) > MAX_RECIPE_NODES:
            raise ConfigError([f"{where} expands to more than {MAX_RECIPE_NODES:,} YAML values (nested aliases?); "
                               "a recipe is a flat mapping of settings."])
        data = loader.construct_document(node) if node is not None else None
        if loader.duplicates:
            raise ConfigError([f"{where} gives {show_value(key)} twice (lines {first} and {again}); keep one."
                               for key, first, again in loader.duplicates])
        return data
    except yaml.YAMLError as exc:
        raise ConfigError([f"{where} is not valid YAML: {exc}"]) from None
    except RecursionError:
        raise ConfigError([f"{where} is nested too deeply; a recipe is a flat mapping of settings."]) from None
    finally:
        loader.dispose()


@functools.cache
def _recipe_loader() -> type:
    """yaml.SafeLoader that records every key a mapping gives twice, with both lines, in `duplicates`."""
    import yaml

    class RecipeLoader(yaml.SafeLoader):
        def __init__(self, stream: str) -> None:
            super().__init__(stream)
            self.duplicates: list[tuple[Any, int, int]] = []

        def construct_mapping(self, node, deep=False):
            if isinstance(node, yaml.MappingNode):
                self._note_duplicates(node)
            return super().construct_mapping(node, deep=deep)

        def _note_duplicates(self, node) -> None:
            seen: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue  # `<<: *base` merges keys that the mapping's own keys may override
                key = self.construct_object(key_node, deep=True)
                line = key_node.start_mark.line + 1
                try:
                    if key in seen:
                        self.duplicates.append((key, seen[key], line))
                    else:
                        seen[key] = line
                except TypeError:
                    continue  # an unhashable key: SafeLoader refuses it with its own message

    return RecipeLoader


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
        if name in values:
            problems.append(f"{values[name][1]} and {key} in {recipe_name} name the same setting; keep one.")
        values[name] = (raw, f"{key} in {recipe_name}")
    for name, raw in (flags or {}).items():
        if raw is not None:
            values[name] = (raw, flag_name(name))

    parsed, refused = _parse_values(values, problems)
    config = TrainConfig.from_flat(parsed)
    later = config.problems() + (checks(config) if checks is not None else [])
    # A refused value leaves its default in the config: a rule naming that key would judge the default (an
    # unparsed --data reads as "--data is required"), so the parse error alone speaks for the key.
    problems.extend(problem for problem in later if not _about(problem, refused))
    if problems:
        raise ConfigError(problems)
    return config


def _parse_values(values: dict[str, tuple[Any, str]], problems: list[str]) -> tuple[dict[str, Any], set[str]]:
    """The typed value of each key, and the keys whose values were refused (their problems added)."""
    parsed: dict[str, Any] = {}
    refused: set[str] = set()
    for name, (raw, where) in values.items():
        problem = _value_problem(name, raw, where)
        if problem is None:
            try:
                parsed[name] = _parse_value(name, raw)
                continue
            except ValueError as exc:
                problem = f"{where} {show_value(raw)} {exc}."
        problems.append(problem)
        refused.add(name)
    return parsed, refused


def _value_problem(name: str, raw: Any, where: str) -> str | None:
    """What is wrong with the shape of a value before its parser sees it: null for a setting that has a
    value by default, or a list/mapping for a single-valued one."""
    f = FLAT_FIELDS[name][1]
    if raw is None and f.default is not None:
        # Null stands for "no value" only where that is the default (a --dry-run config prints such settings as
        # null and must read back); elsewhere it would reach the run as None and fail deep inside it.
        return f"{where} is empty (null); give a value or remove the key (the default is {_example(f)})."
    if isinstance(raw, (dict, list, tuple, set)) and not f.metadata.get("accepts_list"):
        kind = "mapping" if isinstance(raw, dict) else "list"
        return f"{where} is a {kind}, but {name} takes a single value, e.g. {name}: {_example(f)}."
    return None


def _parse_value(name: str, raw: Any) -> Any:
    return None if raw is None else FLAT_FIELDS[name][1].metadata["parser"](raw)


def _about(problem: str, keys: set[str]) -> bool:
    """Whether `problem` names the flag of one of `keys` (`--data`, not `--eval-data` or `--data-x`)."""
    return any(re.search(rf"(?<![\w-]){re.escape(flag_name(key))}(?![\w-])", problem) for key in keys)


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
