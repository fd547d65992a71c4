"""Issue 34: the estimate's byte model of attention-free models (Mamba, FalconMamba, Mamba-2: no attention heads, no
MLP): the mixer's projections in the FLOPs, its conv, states and scan in a layer's backward, no attention terms,
and the analytic peak within 3 % of the trace (`lstune estimate --trace`, fake tensors on the CPU) as for the other
architectures (tests/unit/estimate/test_trace.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from lstune.estimate.shapes import ModelShape, count_parameters
from lstune.models.presets import preset_config
from lstune.train.trace import grid_row


@pytest.mark.parametrize("model", ["tiny-mamba", "tiny-mamba2"])
def test_an_attention_free_shape_has_its_mixer_and_no_attention_or_mlp(model):
    config = preset_config(model)
    shape = ModelShape.from_config(config)  # refused with a ModelError before issue 34's estimate rows
    assert shape.attention_free and shape.attention_pairs(4096) == 0 and shape.intermediate == 0
    assert shape.linear_layers == shape.layers == 2 and shape.state_elements and shape.conv_channels
    # The projections one token multiplies: every weight of a layer but the conv, dt bias, A, D and the norms
    params = count_parameters(config)
    small = 64 * 8 * 4 + 2 * 64 * 8  # under every layer's conv, A, D, dt bias and norms (tiny presets)
    assert params.largest_layer - small <= shape.layer_matmul_params() <= params.largest_layer


def test_an_unknown_model_without_attention_heads_is_still_refused():
    from lstune.errors import ModelError

    config = SimpleNamespace(model_type="rwkv", hidden_size=32, num_hidden_layers=2, vocab_size=64)
    with pytest.raises(ModelError, match="no byte model of rwkv, a model without attention heads"):
        ModelShape.from_config(config)


@pytest.mark.parametrize("model, setting, seq, gpu", [
    # bf16 (an H100 target): the torch chunked scan's rows, fitted on tiny-mamba2 from 512 to 8K tokens
    ("tiny-mamba2", "full fine-tune", 2048, "h100-80gb"),  # -1.1 %
    ("tiny-mamba2", "LoRA defaults", 2048, "h100-80gb"),  # -0.0 %
    ("tiny-mamba2", "full fine-tune", 8192, "h100-80gb"),  # -1.7 % (-15.7 % without the states' passing, quadratic)
    ("tiny-mamba2", "LoRA defaults", 512, "cpu"),  # fp32: +1.1 %
    # the reference selective scan: 7 fp32 copies of inner · state per token (6 in fp32)
    ("tiny-mamba", "LoRA defaults", 128, "h100-80gb"),  # -0.6 %
    ("tiny-mamba", "full fine-tune", 256, "cpu"),  # fp32: +0.4 % (+11 % with 7 copies)
])
def test_the_analytic_model_of_an_attention_free_model_is_within_3_percent_of_the_trace(model, setting, seq, gpu):
    row = grid_row(model, setting, seq, gpu=gpu)
    assert abs(row["error"]) <= 0.03, row

def test_an_attention_free_models_sp_all_to_alls_move_its_mixers_streams():
    """Ulysses on a state-space layer moves the in-projection's streams to the rank's heads and the scan's output
    back (lstune.models.mixers), not q, k, v and o: 0 B before (no attention widths)."""
    from lstune.estimate.sequence_parallel import sp_traffic

    shape = ModelShape.from_config(preset_config("tiny-mamba2"))
    assert shape.mixer_exchanged == 2 * 64 + 2 * 2 * 8 + 8 + 64
    t = sp_traffic(shape, seq_len=1024, micro_batch=1, sp=2, ring=1, act_bytes=2, checkpointing=False)
    assert t.ulysses_bytes == 2 * (1 / 2 * 512 * shape.mixer_exchanged * 2) * 2  # 2 layers; forward and backward
