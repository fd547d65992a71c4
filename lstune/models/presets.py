"""Model presets: configs of tiny test architectures and of popular real models, shipped as JSON.

A preset is a plain HF `config.json` plus an `_lstune` block (`about`, `hub_id`). Presets have no
weights: they are random-initialised, so real shapes can be trained and benchmarked with no download.
Tiny presets use the byte-level vocabulary of `lstune.data.tokenizer.ByteTokenizer`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel

PRESET_DIR = Path(__file__).with_name("presets")


@dataclass(frozen=True)
class Preset:
    name: str
    about: str
    hub_id: str | None
    config: dict[str, Any]  # HF config.json content, `model_type` included


@cache
def list_presets() -> dict[str, Preset]:
    presets = {}
    for path in sorted(PRESET_DIR.glob("*.json")):
        raw = json.loads(path.read_text())
        meta = raw.pop("_lstune")
        presets[path.stem] = Preset(path.stem, meta["about"], meta.get("hub_id"), raw)
    return presets


def get_preset(name: str) -> Preset | None:
    """The preset called `name` (case-insensitive; a leading `preset:` is allowed), or None."""
    key = name.lower().removeprefix("preset:")
    return list_presets().get(key)


def preset_config(name: str, **overrides: Any) -> "PretrainedConfig":
    """A transformers config for preset `name`, with `overrides` applied (e.g. num_hidden_layers=2)."""
    from transformers import AutoConfig

    preset = get_preset(name)
    if preset is None:
        raise KeyError(f"no preset named {name!r}; known: {', '.join(list_presets())}")
    kwargs = {**preset.config, **overrides}
    return AutoConfig.for_model(**kwargs)


def build_model(
    name: str, *, seed: int = 0, dtype: Any = None, attn_implementation: str | None = None, **overrides: Any
) -> "PreTrainedModel":
    """A randomly initialised model of preset `name` (fp32 unless `dtype`).

    `attn_implementation` None lets transformers choose (SDPA where the architecture supports it).
    """
    import torch
    from transformers import AutoModelForCausalLM

    config = preset_config(name, **overrides)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(
        config, dtype=dtype or torch.float32, attn_implementation=attn_implementation
    )
