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


@pytest.mark.parametrize("preset,billions", [("qwen3-next-80b-a3b", 79.67), ("gpt-oss-20b", 20.91),
                                             ("qwen3.5-27b", 26.90)])  # its text decoder: no vision tower, no MTP
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


def _saved_by_a_linear_mixer(model_type: str, seq: int, views: bool = True, **extra):
    """Trace one linear mixer's forward (fp32, tiny): (its shape, the bytes backward keeps of its short convolution's
    input and output — the [1, channels, S] tensors saved: the output in its padded storage, the input at its own
    size where it is a view of a wider projection, kept anyway (`views`: False where such views are gates, LFM2's B
    and C, not the convolution's input) — and every storage saved, with its shape)."""
    import torch

    from lstune.models.introspect import find_parts
    from lstune.models.mixers import mixer_sites
    from tests.support.archs import tiny_model

    model = tiny_model(model_type, **extra)
    shape = ModelShape.from_config(model.config)
    _, mixer = mixer_sites(find_parts(model).layers)[0]
    storages, conv = {}, {}
    padded = shape.conv_channels * (seq + shape.conv_kernel - 1) * 4

    def pack(t):
        key = t.untyped_storage().data_ptr()
        storages.setdefault(key, (tuple(t.shape), t.untyped_storage().nbytes()))
        if t.dim() == 3 and t.shape[1] == shape.conv_channels:
            stored = t.untyped_storage().nbytes()
            own = t.numel() * t.element_size()
            if stored in (own, padded) or views:
                conv.setdefault(key, stored if stored == padded else own)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        mixer(torch.randn(1, seq, model.config.hidden_size))
    return shape, sum(conv.values()), storages


def test_a_linear_mixers_conv_and_state_bytes_are_what_its_forward_saves():
    """Qwen3.5's Gated DeltaNet (transformers' torch path, what the trace runs): the convolution keeps its input and
    its padded output (exact), and the chunked recurrence one fp32 state per 64-token chunk (exact); key and value
    head dims differ so that a state is told apart from the other per-chunk tensors."""
    seq = 256
    shape, conv, storages = _saved_by_a_linear_mixer("qwen3_5_text", seq, linear_key_head_dim=8,
                                                     linear_value_head_dim=16)
    assert shape.conv_channels == 2 * 6 * 8 + 12 * 16 and shape.conv_kernel == 4
    assert conv == shape.linear_conv_bytes(seq, 4)
    states = sum(n for dims, n in storages.values() if dims == (12, 8, 16))  # heads, key dim, value dim
    assert states == shape.linear_state_bytes(seq) == 4 * 12 * 8 * 16 * (seq // 64)


@pytest.mark.parametrize("model_type,channels,views", [
    ("bamba", 6 * 8 + 2 * 2 * 8, True),  # Mamba-2: heads · head dim + B and C of each group; input sliced from in_proj
    ("nemotron_h", 6 * 8 + 2 * 2 * 8, True),
    ("lfm2", 32, False),  # the hidden width; the convolution's input is B · x, its own tensor
])
def test_other_families_conv_bytes_are_what_their_forward_saves(model_type, channels, views):
    shape, conv, _ = _saved_by_a_linear_mixer(model_type, 96, views)
    assert shape.conv_channels == channels
    assert conv == shape.linear_conv_bytes(96, 4)


def test_the_conv_and_state_rows_are_separate_in_a_hybrids_layer_backward():
    settings = Settings(seq_len=S, micro_batch=1, sp=1, world=1, engine=Engine("torch"), lora_r=16, on_cuda=True,
                        dtype="auto", tiled_mlp="auto", tiled_loss="auto", mini_sequence=False, checkpointing=True,
                        offload_checkpoints=True, host_mem_budget=None)
    shape = ModelShape.from_config(preset_config("qwen3.5-27b"))
    assert (shape.conv_channels, shape.conv_kernel, shape.state_elements) == (2 * 16 * 128 + 48 * 128, 4,
                                                                              48 * 128 * 128)
    parts = dict(_layer_parts(shape, count_parameters(preset_config("qwen3.5-27b", num_hidden_layers=4), lora_r=16),
                              settings, 2, 2))
    conv = [value for name, value in parts.items() if "short convolution" in name]
    assert conv == [10240 * (2 * S + 3) * 2] and parts[STATE_PART] == 4 * 48 * 128 * 128 * (S // 64)


def test_an_attention_free_model_is_refused_by_the_estimate_with_a_user_error():
    """No byte model of a pure state-space model yet: a clear refusal (exit 2), not a ValueError traceback."""
    from transformers import MambaConfig

    from lstune.errors import ModelError

    with pytest.raises(ModelError, match="no byte model of a model without attention heads \\(mamba"):
        ModelShape.from_config(MambaConfig(hidden_size=32, num_hidden_layers=2))
