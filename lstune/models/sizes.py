"""One check of a model config's sizes, made before anything is built from them.

A config.json lstune did not write may hold any JSON: a negative layer count, zero heads (transformers divides
by it), NaN, infinity, a string, 10^15. Each would fail later as a traceback deep in transformers or torch, or
be blamed on something else (a negative layer count reads as "no list of decoder layers"). `size_problems`
names every such key at once; `resolve_model` runs it on the raw config.json of a local folder (before
transformers reads it) and on every config it returns (hub, preset, remote code).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

# Keys that hold a count or a size across transformers' architectures (GPT-2 and T5 era spellings included).
# Each must be a whole number of at least 1 where present; None means "not set" (head_dim, num_key_value_heads).
SIZE_KEYS = (
    "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "head_dim", "vocab_size", "max_position_embeddings", "moe_intermediate_size", "shared_expert_intermediate_size",
    "num_experts", "num_local_experts", "num_experts_per_tok", "n_routed_experts", "n_embd", "n_layer", "n_head",
    "n_inner", "n_positions", "d_model", "num_layers", "num_heads", "ffn_dim", "d_ff",
)

# No dimension of a trainable model comes near this; past it one [seq, size] tensor overflows int32 indexing
# at any sequence length, and estimates turn into nonsense (10^15 hidden: petabytes, not a refusal).
MAX_SIZE = 2**31 - 1


def size_problems(values: Mapping[str, Any], where: str) -> list[str]:
    """Every impossible size in `values` (a config as a dict; sub-configs such as text_config included)."""
    problems = []
    for key, value in values.items():
        if isinstance(value, Mapping) and key.endswith("_config"):
            problems += size_problems(value, f"{where} {key}")
        elif key in SIZE_KEYS and value is not None:
            for item in value if isinstance(value, list) and value else [value]:  # per-layer sizes (Gemma-3n)
                if reason := _why_not_a_size(item):
                    problems.append(f"{where}: {key} is {_show(item)}, {reason}")
                    break
    return problems


def _why_not_a_size(value: Any) -> str | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return "not a number"
    if isinstance(value, float) and not math.isfinite(value):
        return "not a finite number"
    if isinstance(value, float) and not value.is_integer():
        return "not a whole number"
    if value < 1:
        return "not a positive size"
    if value > MAX_SIZE:
        return f"beyond any model (at most {MAX_SIZE:,})"
    return None


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
