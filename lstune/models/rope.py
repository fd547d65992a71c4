"""RoPE position scaling: extend a model's context by writing transformers' own `rope_parameters`.

lstune computes no rotary frequencies itself: `apply_rope_scaling` rewrites the model config's
`rope_parameters` (transformers 5; `rope_scaling` in older configs) before the model is built, so the
model's rotary embedding computes the scaled frequencies (and YaRN's attention factor) with transformers'
own functions, and `final/config.json` carries them: `from_pretrained` of the saved model reproduces the
trained positions.

The scalings, each with factor F over the original (pretraining) context O:

- linear (position interpolation): every frequency divided by F.
- dynamic (NTK-aware): the base grows with the longest position in the forward; transformers reads O from
  `max_position_embeddings`, so that stays O. Refused under sequence parallelism: each rank would see only its
  shard's positions and compute other frequencies than the full sequence's.

A model's own length-dependent RoPE is checked the same way (`check_length_dependent_rope`): LongRoPE (Phi-3)
chooses short or long factors from the longest position a forward sees; under SP lstune makes every rank choose
from the whole sample (lstune.parallel.rope_sp), with --pack each document from its own length
(lstune.models.rope_documents); both at once past the original context are refused.
- yarn: per-frequency interpolation ramp plus an attention temperature (0.1 ln F + 1).
- llama3: Llama-3.1's piecewise interpolation (low/high frequency factors 1 and 4, Llama-3.1's own).

`auto` factor = seq_len / O (at least 1). A model already scaled can be re-scaled with its own type (the
factor then counts from its original context); another type on top of an existing one is refused, since
transformers composes no two scalings.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from lstune.errors import ModelError

SCALINGS = ("none", "linear", "dynamic", "yarn", "llama3")
# Types whose parameters name the original context (transformers requires it for these).
_NEEDS_ORIGINAL = ("yarn", "llama3")
_LLAMA3_DEFAULTS = {"low_freq_factor": 1.0, "high_freq_factor": 4.0}


@dataclass(frozen=True)
class RopeScaling:
    """What `apply_rope_scaling` wrote, for the run's notes."""

    kind: str
    factor: float
    original: int
    max_positions: int

    def note(self) -> str:
        return (f"RoPE scaling {self.kind}, factor {self.factor:g} over {self.original:,} original positions "
                f"(the model now declares {self.max_positions:,}; saved with the model)")


def rope_parameters(config: Any) -> dict | None:
    """The config's flat RoPE parameters, or None (no RoPE, or per-layer-type parameters)."""
    params = getattr(config, "rope_parameters", None)
    if not isinstance(params, dict) or not params or "rope_type" not in params:
        return None
    return params


def max_positions(config: Any) -> int | None:
    value = getattr(config, "max_position_embeddings", None)
    return value if isinstance(value, int) and value > 0 else None


def positions_warning(config: Any, seq_len: int, model_name: str) -> str | None:
    """A warning when training past the model's positions without scaling (the run goes on: the user may mean it)."""
    limit = max_positions(config)
    if limit is None or seq_len <= limit:
        return None
    params = rope_parameters(config)
    scaled = params is not None and params.get("rope_type") not in ("default", None)
    what = f"declares with its {params['rope_type']} scaling" if scaled else "was pretrained with"
    return (f"warning: --seq-len {seq_len:,} is beyond the {limit:,} positions --model {model_name!r} {what}; "
            "positions past them were never seen in training. To extend the context, add --rope-scaling yarn (or "
            "linear, dynamic, llama3) with --rope-factor auto.")


def apply_rope_scaling(
    config: Any, kind: str, factor: float | str, *, seq_len: int, original: int | None = None, sp: int = 1,
    model_name: str = "the model", pack: bool = False,
) -> RopeScaling | None:
    """Write the scaling into `config` (in place, before the model is built); None for `kind` "none".
    ModelError where the model's RoPE cannot take it (no RoPE, per-layer RoPE, another scaling already), or where
    RoPE that depends on the length cannot be exact under this `sp` / `pack` (`check_length_dependent_rope`)."""
    scaling = _apply_rope_scaling(config, kind, factor, seq_len=seq_len, original=original, sp=sp,
                                  model_name=model_name)
    check_length_dependent_rope(config, seq_len=seq_len, sp=sp, pack=pack, model_name=model_name)
    return scaling


# RoPE whose frequencies depend on the longest position a forward sees (transformers' `dynamic_rope_update`).
LENGTH_DEPENDENT = ("longrope", "dynamic")


def length_dependent_rope(config: Any) -> tuple[str, int] | None:
    """(rope type, the length past which its frequencies change) of a model whose RoPE picks its frequencies from
    the longest position each forward sees: LongRoPE (short factors up to `original_max_position_embeddings`, long
    past it) and dynamic NTK (the base grows past the original context). None for any other RoPE."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    params = rope_parameters(text)
    kind = params.get("rope_type") if params else None
    if kind not in LENGTH_DEPENDENT:
        return None
    original = params.get("original_max_position_embeddings") or max_positions(text)
    return (kind, original) if isinstance(original, int) and original > 0 else None


def check_length_dependent_rope(config: Any, *, seq_len: int, sp: int, pack: bool, model_name: str) -> None:
    """ModelError where length-dependent RoPE cannot match the model run on the whole sample (each document alone
    with --pack). LongRoPE is made exact under SP (lstune.parallel.rope_sp: the factors of the whole sample) and
    with --pack in one process (lstune.models.rope_documents: each document the factors of its own length);
    refused: LongRoPE with --pack past the original context under SP (a document's length is spread over the
    ranks), dynamic NTK under SP, and dynamic NTK with --pack past the original context (one row's rotary
    embedding has one set of frequencies, each document needs its own)."""
    found = length_dependent_rope(config)
    if found is None:
        return
    kind, original = found
    if kind == "dynamic" and sp > 1:
        raise ModelError(
            f"--model {model_name!r}: dynamic RoPE scaling recomputes the frequencies from the longest position each "
            f"forward sees; with sequence parallelism ({sp} ranks) each rank sees only its shard, so the ranks would "
            "disagree. Use --rope-scaling yarn or linear, or --sp 1."
        )
    if pack and seq_len > original and kind == "longrope" and sp > 1:
        raise ModelError(
            f"--pack with --sp {sp}: --model {model_name!r} uses LongRoPE, which picks its factors from the length it "
            f"sees (short up to {original:,} positions, long past them); lstune gives each packed document the "
            "factors of its own length in one process (lstune.models.rope_documents), but under sequence "
            "parallelism a document's length is spread over the ranks. Use --sp 1, drop --pack, or use "
            f"--seq-len {original:,} or less."
        )
    if pack and seq_len > original and kind == "dynamic":
        raise ModelError(
            f"--pack: --model {model_name!r} uses dynamic RoPE, which computes its frequencies from the length it "
            f"sees (the original base up to {original:,} positions, another one for each longer length); a packed "
            f"row of --seq-len {seq_len:,} holds documents of many lengths, each of which the model gives the "
            f"frequencies of its own length, and one row cannot. Drop --pack, or use --seq-len {original:,} or less."
        )


def _apply_rope_scaling(
    config: Any, kind: str, factor: float | str, *, seq_len: int, original: int | None, sp: int, model_name: str,
) -> RopeScaling | None:
    if kind == "none":
        return None
    params = _scalable_parameters(config, kind, model_name)
    if kind == "dynamic" and sp > 1:
        raise ModelError(
            f"--rope-scaling dynamic recomputes the frequencies from the longest position each forward sees; with "
            f"sequence parallelism ({sp} ranks) each rank sees only its shard, so the ranks would disagree. Use "
            "--rope-scaling yarn or linear, or --sp 1."
        )
    if params.get("rope_type") == "linear" and not original:
        raise ModelError(f"--rope-scaling linear: --model {model_name!r} is already linearly scaled and its config "
                         "keeps no original context; give --original-max-position-embeddings (its pretraining context).")
    # dynamic keeps its original context in max_position_embeddings (see the module docstring).
    base = original or params.get("original_max_position_embeddings") or max_positions(config)
    if base is None:
        raise ModelError(f"--rope-scaling: --model {model_name!r} declares no max_position_embeddings; give "
                         "--original-max-position-embeddings (its pretraining context length).")
    f = max(1.0, seq_len / base) if factor == "auto" else float(factor)
    new = {key: params[key] for key in ("rope_theta", "partial_rotary_factor") if key in params}
    new.update(rope_type=kind, factor=f)
    if kind in _NEEDS_ORIGINAL:
        new["original_max_position_embeddings"] = base
    if kind == "llama3":
        new.update({key: params.get(key, value) for key, value in _LLAMA3_DEFAULTS.items()})
    config.rope_parameters = new
    # dynamic reads the original context from max_position_embeddings; the others declare the extended one.
    config.max_position_embeddings = base if kind == "dynamic" else max(seq_len, math.ceil(base * f))
    config.validate_rope()
    return RopeScaling(kind, f, base, config.max_position_embeddings)


def _scalable_parameters(config: Any, kind: str, model_name: str) -> dict:
    params = getattr(config, "rope_parameters", None)
    if not isinstance(params, dict) or not params:
        raise ModelError(f"--rope-scaling {kind}: --model {model_name!r} ({config.model_type}) has no rotary "
                         "position embedding to scale; drop --rope-scaling.")
    flat = rope_parameters(config)
    if flat is None:
        raise ModelError(
            f"--rope-scaling {kind}: --model {model_name!r} ({config.model_type}) has RoPE parameters per layer type "
            f"({', '.join(sorted(params))}), which lstune does not rewrite; drop --rope-scaling, or edit rope_parameters "
            "in a copy of the model's config.json."
        )
    current = flat.get("rope_type", "default")
    if current not in ("default", kind):
        raise ModelError(
            f"--rope-scaling {kind}: --model {model_name!r} already uses {current} RoPE scaling (factor "
            f"{flat.get('factor')}), and transformers composes no two scalings. Use --rope-scaling {current} to set "
            "a new factor over its original context, or drop --rope-scaling."
        )
    return flat
