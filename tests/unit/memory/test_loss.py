"""The loss head: logit transforms, tile counts, sum + count semantics, and the O(seq x vocab) term gone."""

from __future__ import annotations

import types

import pytest
import torch

from lstune.errors import ModelError
from lstune.memory.loss import (
    LogitTransform,
    alst_loss_policy,
    causal_lm_loss_sum,
    check_loss_head,
    logit_transform,
    loss_sum_from_hidden,
    loss_tile_count,
)
from lstune.memory.tiling import INT32_LIMIT, TilePolicy, tile_bounds
from lstune.models.introspect import find_parts
from lstune.models.presets import build_model
from tests.support.archs import tiny_model
from lstune.memory.measure import LiveBytes
from tests.unit.memory._helpers import hf_loss_sum, long_batch


def _config(**attrs):
    return types.SimpleNamespace(**attrs)


def test_logit_transforms_read_from_configs():
    assert logit_transform(_config(model_type="llama")) == LogitTransform()
    assert logit_transform(_config(model_type="gemma2", final_logit_softcapping=30.0)).softcap == 30.0
    assert logit_transform(_config(model_type="cohere", logit_scale=0.0625)).multiplier == 0.0625
    assert logit_transform(_config(model_type="granite", logits_scaling=8.0)).divisor == 8.0
    assert logit_transform(_config(model_type="hyperclovax", logits_scaling=0.5)).multiplier == 0.5
    assert logit_transform(_config(model_type="falcon_h1", lm_head_multiplier=2.0)).multiplier == 2.0


def test_transform_scales_then_softcaps():
    logits = torch.tensor([-100.0, 0.5, 100.0])
    out = LogitTransform(multiplier=2.0, softcap=30.0)(logits)
    torch.testing.assert_close(out, torch.tanh(logits * 2.0 / 30.0) * 30.0)
    assert out.abs().max() < 30.0


def test_loss_tile_counts():
    vocab = 151936
    auto = alst_loss_policy(vocab)
    assert auto.tile_len * vocab * 4 <= 2**30  # ~1 GiB of fp32 logits per tile
    assert loss_tile_count("auto", 16_000, vocab, 1024) == -(-16_000 // auto.tile_len)
    assert loss_tile_count("off", 16_000, vocab, 1024) == 1
    assert loss_tile_count(5, 16_000, vocab, 1024) == 5
    # An explicit count too small for int32 kernels is raised: 1M tokens x 152K vocab.
    tiles = loss_tile_count(2, 1_000_000, vocab, 1024)
    assert max(e - s for s, e in tile_bounds(1_000_000, tiles)) * vocab < INT32_LIMIT


@pytest.mark.parametrize("arch", ["tiny-llama", "tiny-qwen3", "tiny-gemma2", "tiny-gemma3"])
@pytest.mark.parametrize("tiles", ["off", "auto", 1, 4, 13, TilePolicy(count=3)])
def test_every_tiling_gives_hf_loss_sum_and_count(arch, tiles):
    """Untied and tied (Qwen3, Gemma) heads, Gemma-2's softcap; counts exclude ignored labels."""
    model = build_model(arch)
    batch = long_batch(60)
    with torch.no_grad():
        ref, ref_count = hf_loss_sum(model, batch)
        loss, count = causal_lm_loss_sum(model, batch, tiles=tiles)
    assert loss.dtype == torch.float32 and loss.dim() == 0
    assert count.dtype == torch.int64 and count.item() == ref_count.item() == 60 - 1 - 9  # last + every 7th
    assert loss.item() == pytest.approx(ref.item(), rel=1e-5)


def test_tiles_of_only_ignored_labels_add_nothing():
    model = build_model("tiny-mistral")
    batch = long_batch(40)
    batch["shift_labels"][:, :30] = -100
    with torch.no_grad():
        ref, _ = hf_loss_sum(model, batch)
        loss, count = causal_lm_loss_sum(model, batch, tiles=8)
    assert count.item() == 8  # positions 30-38 but 35 (every 7th); 39 is the last
    assert loss.item() == pytest.approx(ref.item(), rel=1e-5)


def test_all_labels_ignored_gives_zero_and_a_zero_gradient():
    model = build_model("tiny-mistral")
    batch = long_batch(20)
    batch["shift_labels"][:] = -100
    loss, count = causal_lm_loss_sum(model, batch, tiles=3)
    loss.backward()
    assert loss.item() == 0.0 and count.item() == 0
    assert model.lm_head.weight.grad.abs().max() == 0


def test_check_loss_head_catches_an_unknown_logit_transform():
    model = build_model("tiny-llama")
    check_loss_head(find_parts(model))
    model.config.final_logit_softcapping = 2.0  # lstune would softcap; Llama's forward does not
    with pytest.raises(ModelError, match="does not reproduce"):
        check_loss_head(find_parts(model))


def test_check_loss_head_refuses_a_config_asking_for_the_router_loss():
    model = tiny_model("mixtral")
    check_loss_head(find_parts(model))  # HF's default: no router loss, exact
    model.config.output_router_logits = True  # Mixtral's forward now adds router_aux_loss_coef x its balance loss
    with pytest.raises(ModelError, match="load-balancing loss .*output_router_logits"):
        check_loss_head(find_parts(model))
    model.config.router_aux_loss_coef = model.router_aux_loss_coef = 0.0  # a zero coefficient adds nothing: exact
    check_loss_head(find_parts(model))


def test_check_loss_head_catches_a_term_the_forward_adds_to_the_loss():
    model = build_model("tiny-llama")
    forward = model.forward

    def with_extra_term(*args, **kwargs):  # a remote model's z-loss, say: its forward adds it when given labels
        out = forward(*args, **kwargs)
        if out.loss is not None:
            out.loss = out.loss + 1e-2 * out.logits.float().logsumexp(-1).pow(2).mean()
        return out

    model.forward = with_extra_term
    with pytest.raises(ModelError, match="own loss is not token cross-entropy"):
        check_loss_head(find_parts(model))


def _head_peak(model, seq: int, tiles) -> int:
    hidden = torch.randn(1, seq, model.config.hidden_size, requires_grad=True)
    labels = torch.randint(0, model.config.vocab_size, (1, seq))

    def step():
        loss, _ = loss_sum_from_hidden(model, hidden, labels, tiles=tiles)
        loss.backward()

    model.zero_grad(set_to_none=True)
    with LiveBytes() as live:
        step()
    model.zero_grad(set_to_none=True)
    return live.peak


def test_tiled_loss_removes_the_seq_times_vocab_term():
    """Peak bytes of the loss head at 256 and 512 tokens: plain grows by >= 2 fp32 copies of the logits
    per token (vocab 8192), tiled (64 tokens per tile) only by a few hidden-size vectors."""
    model = build_model("tiny-llama", num_hidden_layers=1, vocab_size=8192)
    vocab, hidden = 8192, model.config.hidden_size
    per_token = {}
    for name, tiles in (("plain", "off"), ("tiled", TilePolicy(tile_len=64))):
        p1, p2 = _head_peak(model, 256, tiles), _head_peak(model, 512, tiles)
        per_token[name] = (p2 - p1) / 256
    assert per_token["plain"] >= 2 * 4 * vocab
    assert per_token["tiled"] <= 4 * 4 * hidden  # hidden grad + tile bookkeeping, no vocab term
