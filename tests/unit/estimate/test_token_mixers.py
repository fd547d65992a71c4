"""The estimate's per-layer token mixers (lstune.estimate.shapes): softmax attention pairs only in attention layers
(hybrids), chunked attention (Llama-4), the linear mixers' recurrence FLOPs (linear in length) and recurrent-state
bytes, sinks; and the presets that let users estimate Qwen3-Next and gpt-oss without a download."""

from __future__ import annotations

from dataclasses import replace

import pytest

from lstune.estimate.flops import step_flops
from lstune.estimate.memory import Engine, Settings, _layer_parts
from lstune.estimate.shapes import ModelShape, count_parameters
from lstune.models.presets import preset_config

S = 65536
STATE_PART = "layer backward: a linear-attention / state-space mixer's recurrent states (fp32, one per 64-token chunk)"


@pytest.mark.parametrize("preset,billions", [("qwen3-next-80b-a3b", 79.67), ("gpt-oss-20b", 20.91)])
def test_the_presets_build_the_published_models(preset, billions):
    """80B / 21B parameters on a meta build, as their model cards say."""
    assert count_parameters(preset_config(preset)).total / 1e9 == pytest.approx(billions, abs=0.01)


def test_qwen3_next_attention_pairs_are_its_12_attention_layers_and_its_recurrence_is_linear():
    shape = ModelShape.from_config(preset_config("qwen3-next-80b-a3b"))
    assert shape.mixers.count("attention") == 12 and shape.linear_layers == 36
    assert shape.attention_pairs(S) == 12 * S * (S + 1) // 2
    assert shape.state_elements == 32 * 128 * 128  # value heads · key dim · value dim
    assert shape.linear_mixer_flops(2 * S) == 2 * shape.linear_mixer_flops(S) == 2 * 4 * 32 * 128 * 128 * S * 36
    dense = replace(shape, mixers=("attention",) * 48)
    assert step_flops(preset_config("qwen3-next-80b-a3b"), S, lora=True, checkpointing=True).model < \
        _flops_as_if_all_attention(dense)


def _flops_as_if_all_attention(shape: ModelShape) -> float:
    """Attention FLOPs alone, had all 48 layers been softmax attention: more than the hybrid's whole step."""
    return 4 * shape.head_dim * shape.heads * shape.attention_pairs(S) * 3


def test_the_recurrent_states_are_in_the_layer_backward_of_a_hybrid_only():
    settings = Settings(seq_len=S, micro_batch=1, sp=1, world=1, engine=Engine("torch"), lora_r=16, on_cuda=True,
                        dtype="auto", tiled_mlp="auto", tiled_loss="auto", mini_sequence=False, checkpointing=True,
                        offload_checkpoints=True, host_mem_budget=None)
    hybrid = ModelShape.from_config(preset_config("qwen3-next-80b-a3b"))
    parts = dict(_layer_parts(hybrid, count_parameters(preset_config("qwen3-next-80b-a3b"), lora_r=16), settings, 2, 2))
    assert parts[STATE_PART] == 4 * 32 * 128 * 128 * (S // 64)  # 2 GiB at 64K tokens
    dense = ModelShape.from_config(preset_config("llama-3.2-1b"))
    assert STATE_PART not in dict(_layer_parts(dense, count_parameters(preset_config("llama-3.2-1b")), settings, 2, 2))


def test_gpt_oss_has_sinks_and_alternating_windows():
    shape = ModelShape.from_config(preset_config("gpt-oss-20b"))
    assert shape.sinks and shape.linear_layers == 0
    assert shape.windows[:2] == (128, None)
    assert shape.attention_pairs(S) == 12 * (128 * 129 // 2 + (S - 128) * 128) + 12 * S * (S + 1) // 2


def test_chunked_attention_layers_count_pairs_within_their_chunks():
    from transformers import AutoConfig

    config = AutoConfig.for_model("llama4_text", num_hidden_layers=2, attention_chunk_size=8192,
                                  layer_types=["chunked_attention", "full_attention"])
    shape = ModelShape.from_config(config)
    assert shape.chunks == (8192, None)
    assert shape.attention_pairs(S) == 8 * 8192 * 8193 // 2 + S * (S + 1) // 2
