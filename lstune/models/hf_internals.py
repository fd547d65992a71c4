"""Every touch of a private or version-sensitive transformers API, in one module.

lstune installs its attention through transformers' attention registries and reads a few private
attributes to undo that exactly; it also asks the auto-model mapping whether a config is a causal LM, and
tests and the memory tracer switch off packed-sequence detection. All of it is here, so the next
transformers release breaks this one file, loudly: tests/unit/models/test_hf_internals.py checks each
accessor against the installed version and pins SUPPORTED to pyproject's requirement.

Written against transformers 5.17-5.23.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

# Kept equal to pyproject's `transformers` requirement (a test checks both and the installed version).
SUPPORTED = (">=5.17", "<6")


def register_attention(key: str, attention_fn: Callable, mask_fn: Callable) -> None:
    """Register an attention function and its mask function under `key` (process-wide registries)."""
    from transformers.masking_utils import AttentionMaskInterface
    from transformers.modeling_utils import AttentionInterface

    AttentionInterface.register(key, attention_fn)
    AttentionMaskInterface.register(key, mask_fn)


def unregister_attention(key: str) -> None:
    """Remove `key` from both registries (transformers has no public way to unregister)."""
    from transformers.masking_utils import AttentionMaskInterface
    from transformers.modeling_utils import AttentionInterface

    AttentionInterface._global_mapping.pop(key, None)
    AttentionMaskInterface._global_mapping.pop(key, None)


def attention_function(key: str) -> Callable | None:
    """The attention function registered under `key` (built-in or added), or None."""
    from transformers.modeling_utils import AttentionInterface

    return AttentionInterface._global_mapping.get(key)


def attention_mask_function(key: str) -> Callable | None:
    """The mask function registered under `key`, or None."""
    from transformers.masking_utils import AttentionMaskInterface

    return AttentionMaskInterface._global_mapping.get(key)


def attention_interface(config: Any, default: Callable | None) -> Callable:
    """The attention function a model's own code calls for `config` (transformers' lookup: `default` for eager)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation, default)


def attention_implementation(config: Any) -> str | None:
    """The attention implementation a config names (resolved, as the model runs it)."""
    return config._attn_implementation


def raw_attention_implementation(config: Any) -> str | None:
    """The value `set_attn_implementation` changes; saved to restore it exactly."""
    return config._attn_implementation_internal


def restore_attention_implementation(config: Any, value: str | None) -> None:
    config._attn_implementation_internal = value


def is_causal_lm_config(config: Any) -> bool:
    """AutoModelForCausalLM can build this config (a registered class, or remote code that says so)."""
    from transformers import AutoModelForCausalLM

    return type(config) in AutoModelForCausalLM._model_mapping or bool(getattr(config, "auto_map", None))


@contextlib.contextmanager
def traceable_grouped_mm() -> Iterator[None]:
    """Within the block transformers' MoE experts take their own grouped-matmul fallback for weights that are not
    bf16, as they already do under torch.compile.

    torch's meta kernel of `_grouped_mm` (which fake tensors run) keeps CUDA's old bf16-only check, so an fp32
    expert weight (a full fine-tune's) failed the memory trace although the real CPU and CUDA kernels take it.
    transformers' fallback has a fake kernel of its own for every dtype and saves the same tensors for backward
    (input, weight, offsets), so the trace's bytes are the run's.
    """
    from unittest import mock

    import torch

    try:
        from transformers.integrations import moe

        real = moe._can_use_grouped_mm
    except (ImportError, AttributeError):  # a transformers without grouped-mm experts: nothing to redirect
        yield
        return

    def can_use(input, weight, offs) -> bool:
        return real(input, weight, offs) and weight.dtype == torch.bfloat16

    with mock.patch.object(moe, "_can_use_grouped_mm", can_use):
        yield


@contextlib.contextmanager
def no_packed_sequence_detection() -> Iterator[None]:
    """Within the block transformers treats every row as one document when it builds masks.

    Under fake tensors it cannot read position_ids, assumes a packed batch and builds a seq x seq mask
    that real data would not get; the memory tracer (and its tests) state what real data would show.
    """
    from unittest import mock

    with mock.patch("transformers.masking_utils.find_packed_sequence_indices", lambda position_ids: None):
        yield
