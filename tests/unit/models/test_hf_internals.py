"""The one module that touches transformers internals: each accessor works on the installed version, the
supported range matches pyproject, and no other lstune module reaches into transformers' private API."""

from __future__ import annotations

import re
from pathlib import Path

from lstune.models import hf_internals
from lstune.models.presets import build_model, preset_config

PACKAGE = Path(hf_internals.__file__).resolve().parents[1]
PRIVATE = re.compile(r"_global_mapping|\._attn_implementation|_model_mapping|"
                     r"masking_utils|modeling_utils|find_packed_sequence_indices|_can_use_grouped_mm")


def test_installed_transformers_is_in_the_supported_range():
    import transformers
    from packaging.specifiers import SpecifierSet

    assert transformers.__version__ in SpecifierSet(",".join(hf_internals.SUPPORTED))
    pyproject = (PACKAGE.parent / "pyproject.toml").read_text()
    assert f'"transformers{",".join(hf_internals.SUPPORTED)}"' in pyproject


def test_registering_routes_a_model_and_unregistering_removes_the_key():
    model = build_model("tiny-llama", attn_implementation="sdpa")
    before = hf_internals.raw_attention_implementation(model.config)
    calls = []

    def attention(module, query, key, value, attention_mask, **kwargs):
        calls.append(attention_mask)
        return query.transpose(1, 2), None

    hf_internals.register_attention("lstune_internals_test", attention, lambda **_: None)
    try:
        assert hf_internals.attention_function("lstune_internals_test") is attention
        model.set_attn_implementation("lstune_internals_test")
        assert hf_internals.attention_implementation(model.config) == "lstune_internals_test"
        assert hf_internals.attention_interface(model.config, None) is attention  # as the model's own code looks it up
        import torch

        model(input_ids=torch.tensor([[1, 2, 3]]), use_cache=False)
        assert calls and calls[0] is None  # the mask function was used: no mask built
    finally:
        hf_internals.restore_attention_implementation(model.config, before)
        hf_internals.unregister_attention("lstune_internals_test")
    assert hf_internals.attention_function("lstune_internals_test") is None
    assert hf_internals.attention_implementation(model.config) == "sdpa"
    eager = object()
    model.set_attn_implementation("eager")
    assert hf_internals.attention_interface(model.config, eager) is eager  # eager: the model's own default


def test_causal_lm_configs_are_told_apart():
    from transformers import ViTConfig

    assert hf_internals.is_causal_lm_config(preset_config("tiny-qwen3"))
    assert not hf_internals.is_causal_lm_config(ViTConfig())


def test_packed_sequence_detection_can_be_switched_off():
    import torch
    from transformers import masking_utils

    packed = torch.tensor([[0, 1, 2, 0, 1]])
    assert masking_utils.find_packed_sequence_indices(packed) is not None
    with hf_internals.no_packed_sequence_detection():
        assert masking_utils.find_packed_sequence_indices(packed) is None


def test_no_other_module_touches_transformers_internals():
    """Nor does any test but this file: tests read internals through the same accessors, so a transformers
    release that moves one breaks this file alone."""
    sources = [*PACKAGE.rglob("*.py"), *(PACKAGE.parent / "tests").rglob("*.py")]
    offenders = [
        f"{path.relative_to(PACKAGE.parent)}:{number}"
        for path in sources
        if path.name not in ("hf_internals.py", "test_hf_internals.py")
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if PRIVATE.search(line) and not line.lstrip().startswith(("#", "`")) and "`" not in line
    ]
    assert not offenders, offenders


def test_fp32_experts_trace_on_fake_tensors_through_transformers_fallback():
    """torch's meta `_grouped_mm` accepts bf16 only; an fp32 MoE (a full fine-tune) failed `--trace` before."""
    import pytest
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    model = build_model("tiny-qwen3-moe", attn_implementation="sdpa")
    with FakeTensorMode(allow_non_fake_inputs=True):
        model.to_empty(device="cpu")
        ids = torch.zeros(1, 8, dtype=torch.long)
        with pytest.raises(RuntimeError, match="BF16"):
            model(input_ids=ids).logits.sum().backward()
        with hf_internals.traceable_grouped_mm():
            logits = model(input_ids=ids).logits
            logits.sum().backward()
    assert logits.shape == (1, 8, model.config.vocab_size)
