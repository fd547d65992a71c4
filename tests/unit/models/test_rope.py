"""RoPE scaling: the frequencies of the scaled model are transformers' own for each type; refusals; the warning."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from lstune.errors import ModelError
from lstune.models.presets import preset_config
from lstune.models.rope import apply_rope_scaling, positions_warning

NATIVE, SEQ = 64, 256  # a model pretrained at 64 positions, trained at 256: auto factor 4

# What transformers' documentation says each scaling's config is, written out by hand (not by lstune).
EXPECTED = {
    "linear": ({"rope_type": "linear", "factor": 4.0}, SEQ),
    "dynamic": ({"rope_type": "dynamic", "factor": 4.0}, NATIVE),
    "yarn": ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": NATIVE}, SEQ),
    "llama3": ({"rope_type": "llama3", "factor": 4.0, "original_max_position_embeddings": NATIVE,
                "low_freq_factor": 1.0, "high_freq_factor": 4.0}, SEQ),
}


def short_llama():
    config = preset_config("tiny-llama")
    config.max_position_embeddings = NATIVE
    return config


def reference_rotary(kind: str) -> LlamaRotaryEmbedding:
    params, max_positions = EXPECTED[kind]
    base = short_llama()
    config = LlamaConfig(**{**base.to_dict(), "max_position_embeddings": max_positions,
                            "rope_parameters": {**params, "rope_theta": 10000.0}})
    return LlamaRotaryEmbedding(config)


def cos_sin(rotary, positions: torch.Tensor):
    x = torch.zeros(1, positions.shape[-1], 8)
    return rotary(x, positions)


@pytest.mark.parametrize("kind", list(EXPECTED))
def test_scaled_model_has_transformers_frequencies(kind):
    config = short_llama()
    scaling = apply_rope_scaling(config, kind, "auto", seq_len=SEQ)
    assert (scaling.factor, scaling.original) == (4.0, NATIVE)
    model = AutoModelForCausalLM.from_config(config)
    positions = torch.arange(SEQ)[None]
    cos, sin = cos_sin(model.model.rotary_emb, positions)
    ref_cos, ref_sin = cos_sin(reference_rotary(kind), positions)
    torch.testing.assert_close(cos, ref_cos, rtol=0, atol=0)
    torch.testing.assert_close(sin, ref_sin, rtol=0, atol=0)
    assert model.model.rotary_emb.attention_scaling == reference_rotary(kind).attention_scaling
    plain_cos, _ = cos_sin(AutoModelForCausalLM.from_config(short_llama()).model.rotary_emb, positions)
    assert not torch.allclose(cos, plain_cos)  # the scaling changed something


def test_yarn_attention_factor_is_applied():
    config = short_llama()
    apply_rope_scaling(config, "yarn", 4.0, seq_len=SEQ)
    rotary = AutoModelForCausalLM.from_config(config).model.rotary_emb
    assert rotary.attention_scaling == pytest.approx(0.1 * torch.log(torch.tensor(4.0)).item() + 1)


def test_explicit_factor_and_original():
    config = short_llama()
    scaling = apply_rope_scaling(config, "yarn", 8, seq_len=SEQ, original=32)
    assert config.rope_parameters["factor"] == 8.0
    assert config.rope_parameters["original_max_position_embeddings"] == 32
    assert config.max_position_embeddings == 256 == scaling.max_positions


def test_auto_factor_is_at_least_one():
    config = short_llama()
    assert apply_rope_scaling(config, "linear", "auto", seq_len=32).factor == 1.0


def test_none_leaves_the_config_alone():
    config = short_llama()
    before = dict(config.rope_parameters)
    assert apply_rope_scaling(config, "none", "auto", seq_len=SEQ) is None
    assert config.rope_parameters == before and config.max_position_embeddings == NATIVE


def test_llama3_model_rescaled_from_its_original_context():
    config = preset_config("llama-3.1-8b")
    scaling = apply_rope_scaling(config, "llama3", "auto", seq_len=512 * 1024)
    assert (scaling.original, scaling.factor) == (8192, 64.0)
    assert config.rope_parameters["high_freq_factor"] == 4.0


def test_another_scaling_on_top_is_refused():
    with pytest.raises(ModelError, match="already uses llama3 RoPE scaling.*--rope-scaling llama3"):
        apply_rope_scaling(preset_config("llama-3.1-8b"), "yarn", "auto", seq_len=512 * 1024)


def test_per_layer_type_rope_is_refused():
    with pytest.raises(ModelError, match="per layer type"):
        apply_rope_scaling(preset_config("tiny-gemma3"), "yarn", 2.0, seq_len=SEQ)


def test_dynamic_under_sequence_parallelism_is_refused():
    with pytest.raises(ModelError, match="dynamic.*--sp 1"):
        apply_rope_scaling(short_llama(), "dynamic", "auto", seq_len=SEQ, sp=2)


def test_warning_past_the_positions_names_the_fix():
    assert positions_warning(short_llama(), NATIVE, "m") is None
    text = positions_warning(short_llama(), SEQ, "m")
    assert "beyond the 64 positions" in text and "--rope-scaling yarn" in text


def test_warning_for_the_qwen3_128k_recipe():
    text = positions_warning(preset_config("qwen3-8b"), 128 * 1024, "qwen3-8b")
    assert "40,960" in text and "--rope-factor auto" in text


def _longrope_config(original: int = 32):
    from tests.support.archs import tiny_config

    return tiny_config("phi3", max_position_embeddings=128, original_max_position_embeddings=original,
                       rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                        "original_max_position_embeddings": original,
                                        "short_factor": [1.0, 1.1, 1.3, 1.7], "long_factor": [1.0, 2.0, 4.0, 8.0]})


def test_longrope_with_pack_past_the_original_context_is_refused_under_sp_and_within_it_allowed():
    from lstune.errors import ModelError
    from lstune.models.rope import apply_rope_scaling, length_dependent_rope

    config = _longrope_config()
    assert length_dependent_rope(config) == ("longrope", 32)
    # One process: each document its own factors (lstune.models.rope_documents, tests/unit/models/test_rope_documents.py)
    apply_rope_scaling(config, "none", "auto", seq_len=64, pack=True)
    with pytest.raises(ModelError, match=r"--pack with --sp 2: .*LongRoPE.*Use --sp 1, drop --pack, or use "
                                         r"--seq-len 32 or less"):
        apply_rope_scaling(config, "none", "auto", seq_len=64, pack=True, sp=2)
    apply_rope_scaling(config, "none", "auto", seq_len=32, pack=True, sp=2)  # every document within the short factors
    apply_rope_scaling(config, "none", "auto", seq_len=64, sp=2)  # SP: made exact (lstune.parallel.rope_sp)


def test_a_models_own_dynamic_rope_is_refused_under_sp():
    from lstune.errors import ModelError
    from lstune.models.rope import apply_rope_scaling

    config = _longrope_config()
    config.rope_parameters = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}
    with pytest.raises(ModelError, match="dynamic RoPE scaling recomputes the frequencies"):
        apply_rope_scaling(config, "none", "auto", seq_len=64, sp=2)


def test_the_self_check_probe_crosses_a_length_dependent_ropes_original_context():
    from lstune.train.self_check import probe_batch, probe_lengths, truncated_config

    config = _longrope_config(original=100)
    assert max(probe_lengths(config).values()) == 100
    assert probe_batch(config, pack=True, sp=2, vocab=320)["input_ids"].shape[1] > 100
    small = truncated_config(_longrope_config(original=4096))  # a big model's copy: a short original is as good
    assert small.rope_parameters["original_max_position_embeddings"] == 48
