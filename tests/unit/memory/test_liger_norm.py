"""The final norm on the Liger path: normed tile by tile (`loss.normed_in_tiles`) before Liger's fused loss, exactly
(values and every gradient), without the norm's full-sequence fp32 copies, and end to end equal to plain HF.

Liger needs CUDA; here `liger_applies` is forced and a pure-torch stand-in with Liger's signature and semantics (summed
cross-entropy of `input @ weight.T`, `ignore_index`, tanh `softcap`) replaces its function. The loss head's ALST
tiles are shrunk (`LOSS_TILE_BYTES`) so the tiny models' sequences are cut into several uneven tiles.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch
import torch.nn.functional as F

from lstune.memory import apply as apply_mod
from lstune.memory import loss as loss_mod
from lstune.memory.loss import fuse_final_norm, normed_in_tiles
from lstune.memory.measure import LiveBytes
from lstune.models.introspect import find_parts
from lstune.models.presets import build_model
from tests.support.archs import tiny_model
from tests.unit.memory._helpers import assert_grads_match, hf_loss_sum, long_batch, run_grads, run_with_plan

SEQ, TILE = 70, 12  # 6 tiles (tile_bounds: 5 of 12 tokens, 1 of 10)


@pytest.fixture
def small_tiles(monkeypatch):
    """Call with the vocabulary: ALST loss tiles (whose count the norm on the Liger path takes) of TILE tokens."""

    def tile_bytes(vocab: int) -> None:
        monkeypatch.setattr(loss_mod, "LOSS_TILE_BYTES", 4 * TILE * vocab)  # tile_len = that // (4 * vocab)

    return tile_bytes


def _liger_stand_in(input, weight, target, bias=None, *, ignore_index=-100, reduction="mean", softcap=None, **unused):
    """liger_kernel.transformers.functional.liger_fused_linear_cross_entropy, in plain torch (full logits)."""
    assert not unused, unused
    logits = F.linear(input, weight, bias).float()
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    return F.cross_entropy(logits, target, ignore_index=ignore_index, reduction=reduction)


@pytest.fixture
def fake_liger(monkeypatch):
    """Liger 'applies' on CPU, and its function is the stand-in; counts the calls."""
    calls = []

    def stand_in(*args, **kwargs):
        calls.append(args[0].shape)
        return _liger_stand_in(*args, **kwargs)

    functional = types.ModuleType("liger_kernel.transformers.functional")
    functional.liger_fused_linear_cross_entropy = stand_in
    for name, module in (("liger_kernel", types.ModuleType("liger_kernel")),
                         ("liger_kernel.transformers", types.ModuleType("liger_kernel.transformers")),
                         ("liger_kernel.transformers.functional", functional)):
        monkeypatch.setitem(sys.modules, name, module)
    for module in (loss_mod, apply_mod):
        monkeypatch.setattr(module, "liger_applies", lambda head, hidden: type(head) is torch.nn.Linear)
    return calls


# RMSNorm (llama), Gemma's 1 + weight, LayerNorm with a bias (gpt2), Cohere's LayerNorm.
@pytest.mark.parametrize("arch", ["llama", "gemma3_text", "gpt2", "cohere"])
def test_the_norm_in_tiles_equals_the_norm_whole(arch, small_tiles):
    model = tiny_model(arch)
    parts = find_parts(model)
    norm, vocab = parts.final_norm, model.config.vocab_size
    small_tiles(vocab)
    with torch.no_grad():  # not the init's ones or zeros
        for p in norm.parameters():
            p.normal_()
    hidden = torch.randn(SEQ, model.config.hidden_size, requires_grad=True)
    upstream = torch.randn(SEQ, model.config.hidden_size)
    calls = []
    handle = norm.register_forward_hook(lambda module, args, out: calls.append(args[0].shape[0]))
    try:
        whole = norm(hidden)
        expected = torch.autograd.grad(whole, [hidden, *norm.parameters()], upstream)
        undo = fuse_final_norm(parts)
        assert undo is not None
        del calls[:]  # the reference's and the probe's calls
        try:
            tiled = normed_in_tiles(norm, hidden, vocab=vocab)
            got = torch.autograd.grad(tiled, [hidden, *norm.parameters()], upstream)
        finally:
            undo()
    finally:
        handle.remove()
    assert calls == [12, 12, 12, 12, 12, 10] * 2  # forward, then backward's recompute: the norm runs twice
    torch.testing.assert_close(tiled, whole, rtol=1e-6, atol=1e-6)
    for g, ref in zip(got, expected):  # the input's gradient, then the norm's weight (and bias)
        torch.testing.assert_close(g, ref, rtol=1e-6, atol=1e-6 * ref.abs().max().item())


def test_without_a_fused_norm_the_hidden_states_pass_as_they_are():
    hidden = torch.randn(SEQ, 8)
    assert normed_in_tiles(None, hidden, vocab=320) is hidden


HIDDEN, VOCAB = 256, 320


def _norm_peak_per_token(tiled: bool) -> float:  # loss tiles of TILE tokens (small_tiles)
    """Peak bytes per token of the final norm on the Liger path in bf16 (the norm, a consumer that drops the normed
    states and hands back a full-sequence gradient as Liger does, the norm's backward), from its growth between 256
    and 512 tokens; in hidden vectors per token. The norm's input is the last layer's output, there either way."""
    model = build_model("tiny-llama", num_hidden_layers=1, hidden_size=HIDDEN, vocab_size=VOCAB, dtype=torch.bfloat16)
    parts = find_parts(model)
    undo = fuse_final_norm(parts) if tiled else None
    assert (undo is not None) == tiled
    peaks = []
    for seq in (256, 512):
        last_layer_out = torch.randn(seq, HIDDEN, dtype=torch.bfloat16, requires_grad=True)
        weights = torch.randn(seq, HIDDEN, dtype=torch.bfloat16)
        with LiveBytes() as live:
            norm = parts.final_norm
            normed = normed_in_tiles(norm, last_layer_out, vocab=VOCAB) if tiled else norm(last_layer_out)
            loss = (normed * weights).sum()  # saves `weights` (made outside), not the normed states
            del normed
            loss.backward()
        peaks.append(live.peak)
    if undo is not None:
        undo()
    return (peaks[1] - peaks[0]) / 256 / (2 * HIDDEN)


def test_the_norm_in_tiles_removes_the_full_sequence_copies(small_tiles):
    """bf16: HF's RMSNorm keeps an fp32 copy of its input (2 hidden vectors per token) and its output, and its backward
    makes fp32 temporaries of the whole sequence. In tiles, what grows with the sequence is the normed output (or, in
    backward, the consumer's gradient of it) and the input's gradient: every tile's norm is O(tile)."""
    small_tiles(VOCAB)
    plain, tiled = _norm_peak_per_token(False), _norm_peak_per_token(True)
    assert plain >= tiled + 2  # at least the fp32 copy gone
    assert tiled <= 2.25


LOSS_AUTO = dict(tiled_mlp="off", tiled_loss="auto", checkpointing=False)
WITH_THE_REST = dict(attn_chunks=2, tiled_mlp=3, tiled_loss="auto", offload_checkpoints=True)


def _lora(model):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False))
    model.train()
    return model


@pytest.mark.parametrize("training", ["full", "lora"])
@pytest.mark.parametrize("options", [LOSS_AUTO, WITH_THE_REST], ids=["loss", "with-the-rest"])
@pytest.mark.parametrize("arch", ["llama", "cohere", "tiny-gemma2"])  # cohere: a logit scale; gemma2: softcap, tied
def test_the_liger_path_with_the_fused_norm_matches_hf(arch, options, training, fake_liger, small_tiles):
    model = build_model(arch) if arch.startswith("tiny-") else tiny_model(arch, seed=1)
    model = _lora(model) if training == "lora" else model
    small_tiles(model.config.vocab_size)
    batch = long_batch(SEQ)
    reference = run_grads(model, hf_loss_sum, [batch])
    plan, loss, grads = run_with_plan(model, options, SEQ, [batch])
    assert (plan.loss_backend, plan.final_norm_fused) == ("liger", True)
    assert fake_liger == [torch.Size([SEQ, model.config.hidden_size])]  # the whole normed sequence, once
    assert loss == pytest.approx(reference[0], rel=1e-5)
    assert_grads_match(grads, reference[1])
    if training == "full":  # the norm's weight got its gradient through the tiles, compared above
        names = {id(p): n for n, p in model.named_parameters()}
        assert all(names[id(p)] in grads for p in find_parts(model).final_norm.parameters())
