"""Tiled MLP and mini-sequence layers: the O(seq x intermediate) term gone, norms fused only where safe."""

from __future__ import annotations

import logging

import pytest
import torch

from lstune.errors import ModelError
from lstune.memory.apply import _install_verified
from lstune.memory.mlp import (
    LayerCall,
    check_per_token,
    find_fusable_norms,
    install_tiled_blocks,
    undo_tiled_blocks,
)
from lstune.memory.probe import probe_hidden_states, probe_inputs
from lstune.memory.tiling import TilePolicy
from lstune.models.introspect import decoder_layers, find_parts
from lstune.models.presets import build_model
from lstune.memory.measure import LiveBytes, SavedBytes

HIDDEN, INTERMEDIATE = 128, 2048


@pytest.fixture(scope="module")
def wide_llama():
    """A Llama whose MLP is 16x wider than its hidden size, so the intermediate term dominates."""
    return build_model("tiny-llama", num_hidden_layers=1, intermediate_size=INTERMEDIATE)


def _mlp_peak(mlp, seq: int) -> int:
    x = torch.randn(1, seq, HIDDEN, requires_grad=True)
    with LiveBytes() as live:
        mlp(x).sum().backward()
    mlp.zero_grad(set_to_none=True)
    return live.peak


def test_tiled_mlp_removes_the_seq_times_intermediate_term(wide_llama):
    """Peak of one MLP forward+backward at 256 and 512 tokens, auto tiles (ceil(seq / hidden))."""
    layers = decoder_layers(wide_llama)
    mlp = layers[0].mlp
    plain = (_mlp_peak(mlp, 512) - _mlp_peak(mlp, 256)) / 256
    installed = install_tiled_blocks(layers, TilePolicy(tile_len=HIDDEN))
    try:
        tiled = (_mlp_peak(mlp, 512) - _mlp_peak(mlp, 256)) / 256
    finally:
        undo_tiled_blocks(installed)
    assert plain >= 4 * 4 * INTERMEDIATE  # gate, act, up, product: fp32 per token
    assert tiled <= 4 * 4 * HIDDEN  # input, output, their grads: no intermediate-size term


def test_tiled_mlp_saves_only_its_input(wide_llama):
    layers = decoder_layers(wide_llama)
    mlp = layers[0].mlp
    x = torch.randn(1, 512, HIDDEN, requires_grad=True)
    installed = install_tiled_blocks(layers, TilePolicy(tile_len=HIDDEN))
    try:
        with SavedBytes() as saved:
            mlp(x)
    finally:
        undo_tiled_blocks(installed)
    assert saved.bytes == x.numel() * 4
    assert "forward" not in vars(mlp)  # undo left the instance as built


class _CumulativeMix(torch.nn.Module):
    """Not per-token: each position sees the running sum of the later ones (`causal`: of the earlier ones, as a
    convolution or a state-space scan such as Mamba's mixer does)."""

    def __init__(self, hidden, causal=False):
        super().__init__()
        self.proj = torch.nn.Linear(hidden, hidden)
        self.causal = causal

    def forward(self, x):
        return self.proj(x).cumsum(dim=1) if self.causal else self.proj(x).flip(1).cumsum(dim=1).flip(1)


@pytest.mark.parametrize("causal", [False, True], ids=["reads-later-tokens", "causal"])
def test_a_token_mixing_block_is_refused(wide_llama, causal):
    layers = decoder_layers(wide_llama)
    original = layers[0].mlp
    layers[0].mlp = _CumulativeMix(HIDDEN, causal=causal)
    try:
        with pytest.raises(ModelError, match="cannot be sequence-tiled"):
            check_per_token(layers, HIDDEN)
    finally:
        layers[0].mlp = original
    check_per_token(layers, HIDDEN)


def _call(name, module, inp, out):
    return LayerCall(name, module, inp, out)


def test_fusable_norms_found_from_the_call_graph():
    norm, mlp, attn = torch.nn.LayerNorm(4), torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    t = [torch.zeros(1) for _ in range(6)]
    llama_like = [_call("ln1", norm, t[0], t[1]), _call("attn", attn, t[1], t[2]),
                  _call("ln2", norm, t[3], t[4]), _call("mlp", mlp, t[4], t[5])]
    assert find_fusable_norms(llama_like, "mlp") == ("ln2", None)
    gemma_like = llama_like + [_call("post", norm, t[5], t[0])]
    assert find_fusable_norms(gemma_like, "mlp") == ("ln2", "post")
    # Parallel attention + MLP (one norm feeds both): fusing would un-normalise the attention input.
    parallel = [_call("ln", norm, t[0], t[1]), _call("attn", attn, t[1], t[2]), _call("mlp", mlp, t[1], t[3])]
    assert find_fusable_norms(parallel, "mlp") == (None, None)


def test_a_wrong_fusion_is_detected_and_falls_back(caplog):
    """Fusing the *input* norm into the MLP changes the output: the probe catches it, plain tiling is used."""
    model = build_model("tiny-llama", num_hidden_layers=2)
    parts = find_parts(model)
    inputs = probe_inputs(parts)
    reference = probe_hidden_states(parts, inputs)
    wrong = {0: ("input_layernorm", None)}
    with caplog.at_level(logging.WARNING, logger="lstune"):
        installed = _install_verified(parts, TilePolicy(tile_len=HIDDEN), wrong)
    try:
        assert "changed the output" in caplog.text
        assert all(t.pre_norm is None and t.post_norm is None for t in installed)
        torch.testing.assert_close(probe_hidden_states(parts, inputs), reference)
    finally:
        undo_tiled_blocks(installed)


def test_fusing_the_norm_removes_what_it_saves_for_backward():
    """Mini-sequence vs tiled MLP alone, one Llama layer at 256 tokens: the post-attention RMSNorm's
    saved input product and output (2 x seq x hidden fp32) are no longer kept."""
    model = build_model("tiny-llama", num_hidden_layers=1)
    layers = decoder_layers(model)
    batch = {"input_ids": torch.randint(3, 320, (1, 256)), "position_ids": torch.arange(256)[None]}
    saved = {}
    for name, fused in (("tiled", None), ("fused", {0: ("post_attention_layernorm", None)})):
        installed = install_tiled_blocks(layers, TilePolicy(tile_len=HIDDEN), fused)
        try:
            with SavedBytes() as s:
                model.model(**batch, use_cache=False)
            saved[name] = s.bytes
        finally:
            undo_tiled_blocks(installed)
    assert saved["tiled"] - saved["fused"] >= 2 * 256 * HIDDEN * 4


class _ReturnsRouterLogits(torch.nn.Module):
    """An MoE-like block: its output and per-token router outputs, flat [B·t, E] (transformers' layout) and
    [B, t]."""

    def __init__(self, hidden):
        super().__init__()
        self.proj = torch.nn.Linear(hidden, hidden)

    def forward(self, x):
        return self.proj(x), self.proj(x).flatten(0, 1)[:, :3] * 2, x.sum(-1)


def test_a_block_returning_router_outputs_is_tiled_and_they_are_stitched():
    """Issue 34 (gpt-oss, Llama-4): the output is tiled, the extra outputs joined along the tokens exactly as the
    untiled block returns them (batch 2: the flat layout's rows interleave); a gradient reaching them is refused."""
    from lstune.memory.mlp import TiledForward

    block = _ReturnsRouterLogits(8)
    x = torch.randn(2, 7, 8, requires_grad=True)
    check_per_token(torch.nn.ModuleList([torch.nn.ModuleDict({"mlp": block})]), 8, ("mlp",))
    want = block(x)
    got = TiledForward(block, TilePolicy(count=3))(x)
    assert len(got) == 3
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    got[0].sum().backward()
    torch.testing.assert_close(x.grad, torch.autograd.grad(want[0].sum(), x)[0])
    with pytest.raises(ModelError, match="router logits of a sequence-tiled MoE"):
        TiledForward(block, TilePolicy(count=3))(x)[1].sum().backward()


def test_a_block_whose_extra_outputs_are_not_per_token_is_refused():
    from lstune.memory.mlp import TiledForward

    class Pooled(_ReturnsRouterLogits):
        def forward(self, x):
            return self.proj(x), x.mean(dim=(0, 1))

    with pytest.raises(ModelError, match="cannot tell the extra outputs' token dimension"):
        TiledForward(Pooled(8), TilePolicy(count=3))(torch.randn(2, 7, 8))
