"""Attention sinks from (O, lse) (lstune.models.attention_sinks) and lstune's block attention kernel
(lstune.memory.block_attention): forward and every gradient against a dense reference written like HF's eager gpt-oss
attention (the sink a concatenated logit column, dropped after the softmax), fp32/fp64 on CPU."""

from __future__ import annotations

import pytest
import torch

from lstune.errors import ModelError
from lstune.memory.block_attention import block_attention
from lstune.models.attention import document_ids, local_attention
from lstune.models.attention_sinks import apply_sinks, head_sinks, rowsums, sink_gradient


def _reference(q, k, v, positions, *, window=None, softcap=None, sinks=None, scale=None):
    """Dense eager attention, HF gpt-oss style: [B, S, H, D]."""
    batch, heads, seq, dim = q.shape
    group = heads // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = q @ k.transpose(-1, -2) * (scale if scale is not None else dim ** -0.5)
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    docs = document_ids(positions.expand(batch, seq))
    i, j = torch.arange(seq)[:, None], torch.arange(seq)[None]
    allowed = (docs[:, :, None] == docs[:, None, :]) & (j <= i)
    if window is not None:
        allowed &= i - j < window
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    if sinks is not None:
        column = sinks.reshape(1, -1, 1, 1).expand(batch, heads, seq, 1)
        probs = torch.softmax(torch.cat([scores, column], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    return (probs @ v).transpose(1, 2)


def _inputs(seq=40, heads=4, kv_heads=2, dim=8, batch=1, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(batch, h, seq, dim, generator=gen, dtype=dtype).requires_grad_()
               for h in (heads, kv_heads, kv_heads))
    sinks = torch.randn(heads, generator=gen, dtype=dtype).requires_grad_()
    return q, k, v, sinks


def _grads(out, tensors, seed=1):
    gen = torch.Generator().manual_seed(seed)
    upstream = torch.randn(out.shape, generator=gen, dtype=out.dtype)
    return torch.autograd.grad(out, tensors, upstream)


def test_apply_sinks_is_the_softmax_with_one_more_logit_forward_and_backward():
    """O' = O·sigmoid(lse − s), lse' = logaddexp(lse, s): equal to the concatenated-column softmax, and so are the
    gradients of q, k, v and the sinks (autograd through apply_sinks)."""
    q, k, v, sinks = _inputs(seq=12, kv_heads=4)
    positions = torch.arange(12)[None]
    scores = (q @ k.transpose(-1, -2)) * 8 ** -0.5
    scores = scores.masked_fill(torch.ones(12, 12, dtype=torch.bool).triu(1), float("-inf"))
    lse = torch.logsumexp(scores, -1)
    out = torch.softmax(scores, -1) @ v
    out_s, lse_s = apply_sinks(out, lse, sinks.reshape(1, -1, 1))
    ref = _reference(q, k, v, positions, sinks=sinks)
    torch.testing.assert_close(out_s.transpose(1, 2), ref)
    column = sinks.reshape(1, -1, 1).expand_as(lse)
    torch.testing.assert_close(lse_s, torch.logaddexp(lse, column))
    for got, want in zip(_grads(out_s.transpose(1, 2), (q, k, v, sinks)), _grads(ref, (q, k, v, sinks))):
        torch.testing.assert_close(got, want)


def test_sink_gradient_from_the_rowsums_equals_autograd():
    """ds_h = −Σ_rows exp(s_h − lse')·rowsum(dO' ∘ O'): the closed form the kernels use."""
    q, k, v, sinks = _inputs(seq=10, kv_heads=4)
    scores = (q @ k.transpose(-1, -2)) * 8 ** -0.5
    lse, out = torch.logsumexp(scores, -1), torch.softmax(scores, -1) @ v
    out_s, lse_s = apply_sinks(out.detach(), lse.detach(), sinks.reshape(1, -1, 1))
    dout = torch.randn(out_s.shape, dtype=out_s.dtype, generator=torch.Generator().manual_seed(3))
    (want,) = torch.autograd.grad(out_s, sinks, dout)
    got = sink_gradient(lse_s.detach(), rowsums(out_s.detach(), dout), sinks.detach().reshape(1, -1, 1))
    torch.testing.assert_close(got.sum(dim=(0, 2)), want)


def test_head_sinks_slices_a_ranks_heads():
    sinks = torch.arange(9.0)
    assert head_sinks(sinks, 4, 2).tolist() == [4.0, 5.0]
    assert head_sinks(None, 0, 3) is None


CASES = {
    "sinks": dict(sinks=True),
    "sinks_window": dict(sinks=True, window=7),
    "sinks_packed_window": dict(sinks=True, window=7, docs=[17, 9, 14]),
    "softcap_packed": dict(softcap=5.0, docs=[17, 9, 14]),
    "softcap_sinks_window_batch2": dict(softcap=5.0, sinks=True, window=7, batch=2),
}


@pytest.mark.parametrize("case", list(CASES))
def test_block_attention_matches_dense_eager(case):
    """8-token blocks over 40 tokens, fp32 (blocks cross documents and windows; blocks inside one document and
    window take the CPU flash op): output and the gradients of q, k, v and the sinks."""
    options = CASES[case]
    q, k, v, sinks = _inputs(batch=options.get("batch", 1), dtype=torch.float32)
    docs = options.get("docs")
    positions = torch.cat([torch.arange(n) for n in docs])[None] if docs else torch.arange(40)[None]
    sinks_arg = sinks if options.get("sinks") else None
    got = block_attention(q, k, v, position_ids_BS=positions, scaling=None, sliding_window=options.get("window"),
                          softcap=options.get("softcap"), sinks=sinks_arg, block_tokens=8)
    ref = _reference(q, k, v, positions, window=options.get("window"), softcap=options.get("softcap"),
                     sinks=sinks_arg)
    tol = dict(rtol=2e-5, atol=2e-6)
    torch.testing.assert_close(got, ref, **tol)
    tensors = (q, k, v, sinks) if sinks_arg is not None else (q, k, v)
    for name, g, w in zip("qkvs", _grads(got, tensors), _grads(ref, tensors)):
        torch.testing.assert_close(g, w, **tol, msg=lambda m: f"d{name}: {m}")


def test_sinks_applied_per_block_instead_of_once_would_fail(monkeypatch):
    """The merge must see the blocks without sinks: a kernel applying the sink to every block's partial result
    (a tempting mistake) is caught by the comparison above."""
    import lstune.memory.block_attention as blocks

    q, k, v, sinks = _inputs()
    positions = torch.arange(40)[None]
    ref = _reference(q, k, v, positions, sinks=sinks)
    real_forward = blocks.block_forward

    def per_block(kind, q5, k4, v4, allowed, scale, softcap):
        out, lse = real_forward(kind, q5, k4, v4, allowed, scale, softcap)
        return apply_sinks(out, lse, sinks.detach().float().reshape(1, 2, 2, 1))

    monkeypatch.setattr(blocks, "block_forward", per_block)
    got = block_attention(q, k, v, position_ids_BS=positions, scaling=None, sliding_window=None, softcap=None,
                          sinks=sinks, block_tokens=8)
    assert not torch.allclose(got.double(), ref, atol=1e-4)


def test_local_attention_runs_sinks_and_sdpa_softcap_through_the_block_kernel_or_refuses():
    q, k, v, sinks = _inputs(dtype=torch.float32)
    positions = torch.arange(40)[None]
    with pytest.raises(ModelError, match="block_kernel"):
        local_attention(q, k, v, position_ids_BS=positions, sinks=sinks, backend="sdpa")
    with pytest.raises(ModelError, match="block_kernel"):
        local_attention(q, k, v, position_ids_BS=positions, softcap=5.0, backend="sdpa")
    got = local_attention(q, k, v, position_ids_BS=positions, softcap=5.0, sinks=sinks, backend="auto",
                          block_kernel=block_attention)
    torch.testing.assert_close(got, _reference(q, k, v, positions, softcap=5.0, sinks=sinks), rtol=2e-5, atol=2e-6)


def test_a_model_with_sinks_needs_the_block_kernel():
    from lstune.models.attention import use_lstune_attention
    from tests.support.archs import tiny_model

    model = tiny_model("gpt_oss")
    with pytest.raises(ModelError, match="learned attention sinks"):
        use_lstune_attention(model)
    use_lstune_attention(model, block_kernel=block_attention).undo()
