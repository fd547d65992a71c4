"""What an estimate reads of a preset model, kept with the package so that `lstune estimate` of a preset imports
neither torch nor transformers (half of an estimate's time went to importing them and building the model on the
meta device to count its parameters).

For each preset (lstune.models.presets) `preset_facts.json` holds the resolved transformers config (`to_dict()`:
every attribute, defaults included) and the parameter counts of `lstune.estimate.shapes.count_parameters` without
LoRA and with LoRA of rank 1 on the default targets — a LoRA adapter's parameters are r · (in + out), so every count
that depends on the rank scales with it. `tests/unit/estimate/test_preset_facts.py` checks the file against
transformers and peft as installed (a new transformers that changes a default fails it); regenerate it with
`python -m lstune.estimate.preset_facts`.

Anything else — LoRA on other targets, trust_remote_code, a preset missing from the file — takes the full path.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

from lstune.estimate.shapes import ParamCounts, count_parameters

FACTS_PATH = Path(__file__).with_name("preset_facts.json")
_RANK_FIELDS = ("total", "trainable", "adapters")  # ParamCounts' fields that count adapter parameters (r · ...)


class PresetConfig:
    """A preset's resolved transformers config as plain attributes: what the estimate reads (ModelShape, the SP
    degree), not a transformers object. `name` tells `count_parameters` where its counts are."""

    def __init__(self, name: str, values: dict[str, Any]):
        self.__dict__.update(values)
        self._preset_name = name

    def get_text_config(self, *args: Any, **kwargs: Any) -> "PresetConfig":
        return self

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "_preset_name"}


@cache
def _facts() -> dict[str, Any]:
    return json.loads(FACTS_PATH.read_text()) if FACTS_PATH.is_file() else {}


def preset_config_facts(name: str) -> PresetConfig | None:
    """The resolved config of preset `name` (as `--model` names it), or None where the file has none."""
    key = name.lower().removeprefix("preset:")
    entry = _facts().get(key)
    return PresetConfig(key, entry["config"]) if entry else None


def preset_counts(config: Any, *, lora_r: int, lora_targets: Any) -> ParamCounts | None:
    """count_parameters' answer for a PresetConfig from the file, or None where it must build the model."""
    name = getattr(config, "_preset_name", None)
    entry = _facts().get(name) if name else None
    if entry is None or (lora_r and lora_targets != "auto"):
        return None
    if not lora_r:
        return _counts(entry["counts"])
    base, rank1 = entry["counts"], entry["lora_r1"]
    values = {**rank1, **{k: base["total"] + lora_r * rank1["adapters"] if k == "total" else lora_r * rank1[k]
                          for k in _RANK_FIELDS}}
    values["trainable_tensors"] = [lora_r * n for n in rank1["trainable_tensors"]]
    return _counts(values)


def counts_for(config: Any, *, lora_r: int, lora_targets: Any, trust_remote_code: bool = False) -> ParamCounts:
    """The parameter counts of `config`: kept ones for a PresetConfig where the file has them, else
    `count_parameters` of the model built from it (a PresetConfig's transformers config first)."""
    known = preset_counts(config, lora_r=lora_r, lora_targets=lora_targets)
    if known is not None:
        return known
    if isinstance(config, PresetConfig):
        from lstune.models.presets import preset_config

        config = preset_config(config._preset_name)
    return count_parameters(config, lora_r=lora_r, lora_targets=lora_targets, trust_remote_code=trust_remote_code)


def preset_spec(config: Any):
    """The run's model for `lstune estimate` (lstune.train.plan's `spec`) from the kept facts: a preset's
    ModelSpec with its PresetConfig, or None where transformers' own config is needed (not a preset, none kept,
    --rope-scaling, which writes into the config)."""
    from lstune.models.loading import ModelSpec, resolve_source

    facts = preset_config_facts(config.model.name)
    if facts is None or config.model.rope_scaling != "none":
        return None
    return ModelSpec(resolve_source(config.model.name), facts)


def _counts(values: dict[str, Any]) -> ParamCounts:
    fields = dict(values)
    fields["trainable_tensors"] = tuple(fields.get("trainable_tensors", ()))
    fields["norm_widths"] = tuple(fields.get("norm_widths", ()))
    return ParamCounts(**fields)


def _entry(name: str) -> dict[str, Any]:
    """One preset's facts, from transformers and peft (module doc)."""
    from dataclasses import asdict

    from lstune.models.presets import preset_config

    config = preset_config(name)
    base = asdict(count_parameters(config))
    rank1 = asdict(count_parameters(config, lora_r=1))
    if count_parameters(config, lora_r=2).adapters != 2 * rank1["adapters"]:
        raise ValueError(f"{name}: LoRA's parameters do not scale with the rank; leave it to the full path")
    rank1 = {k: (v - base["total"] if k == "total" else v) for k, v in rank1.items()}
    return {"config": json.loads(config.to_json_string(use_diff=False)), "counts": base, "lora_r1": rank1}


def write_facts(path: Path = FACTS_PATH) -> None:
    from lstune.models.presets import list_presets

    facts = {name: _entry(name) for name in list_presets()}
    path.write_text(json.dumps(facts, indent=None, sort_keys=True, separators=(",", ":")) + "\n")


if __name__ == "__main__":
    write_facts()
