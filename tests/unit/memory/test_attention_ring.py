"""Ring attention's hop plan (the distributed equivalence is tests/distributed/test_ring_sp.py)."""

from __future__ import annotations

from lstune.memory.attention_ring import ring_hops


def test_every_hop_without_a_window_and_only_the_near_ones_with_a_short_one():
    assert ring_hops(4, 1024, None) == [0, 1, 2, 3]
    assert ring_hops(8, 1024, 10**9) == list(range(8))
    # Zigzag, window shorter than a piece: position r's early piece r reads piece r-1 (position r-1: hop 1), its late
    # piece 2R-1-r reads piece 2R-2-r (position r+1: hop R-1); the hops between are skipped, sends and all.
    assert ring_hops(8, 1024, 8) == [0, 1, 7]
    assert ring_hops(2, 1024, 8) == [0, 1]
    assert ring_hops(1, 1024, 8) == [0]
    # A window spanning two pieces: the next-but-one positions too.
    assert ring_hops(8, 1024, 1500) == [0, 1, 2, 6, 7]


def test_a_ring_of_one_applies_the_sinks_once_after_its_merge_as_block_attention_does():
    """Sinks through the ring's own Function (one position: hop 0 only, blocks of 5 so rows merge several blocks)
    equal lstune's block attention (equal to HF eager, tests/unit/models/test_attention_sinks.py): output and the
    gradients of q, k, v and the sinks, with packed documents and a sliding window."""
    import types

    import torch

    from lstune.memory import attention_ring
    from lstune.memory.attention_ring import RingAttention
    from lstune.memory.block_attention import block_attention
    from lstune.memory.rotation import Ring

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, 24, 8, generator=g, requires_grad=True) for h in (4, 2, 2))
    sinks = (torch.randn(4, generator=g) * 2).requires_grad_()
    positions = torch.cat([torch.arange(10), torch.arange(14)])[None]
    module = types.SimpleNamespace(is_causal=True)
    results = []
    old, attention_ring.BLOCK_TOKENS = attention_ring.BLOCK_TOKENS, 5  # read again by the backward
    try:
        for run in ("ring", "blocks"):
            if run == "ring":
                out, _ = RingAttention(Ring(1, 0, (0,)))(module, q, k, v, None, position_ids=positions,
                                                         sliding_window=6, s_aux=sinks)
            else:
                out = block_attention(q, k, v, position_ids_BS=positions, scaling=None, sliding_window=6,
                                      softcap=None, sinks=sinks, block_tokens=5)
            weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
            grads = torch.autograd.grad((out * weights).sum(), (q, k, v, sinks))
            results.append((out, *grads))
    finally:
        attention_ring.BLOCK_TOKENS = old
    for mine, reference in zip(*results):
        torch.testing.assert_close(mine, reference, rtol=1e-5, atol=1e-6)
    assert results[0][-1].abs().min() > 0  # every head's sink had a gradient


def test_a_ring_called_by_chunked_attention_hands_the_call_to_its_sink_with_the_ring():
    """Chunked attention under a ring (issue 35): the ring kernel runs no hops of its own inside a chunk; the chunk sink
    gets the call, with the ring group to gather the chunk's K/V over (replaces the former refusal)."""
    import types

    import torch

    from lstune.memory.attention_ring import RingAttention
    from lstune.memory.rotation import Ring
    from lstune.models.attention import chunked_attention_calls

    calls = []

    class Sink:
        mask_positions, mask_seq = None, 4

        def __call__(self, query, key, value, **kwargs):
            calls.append(kwargs)
            return torch.ones(1, 4, 2, 8)

    ring = Ring(1, 0, (0,))
    q = k = v = torch.zeros(1, 2, 4, 8)
    with chunked_attention_calls(Sink()):
        out, _ = RingAttention(ring)(types.SimpleNamespace(is_causal=True), q, k, v, None,
                                     position_ids=torch.arange(4)[None], sliding_window=3, scaling=0.5)
    assert torch.equal(out, torch.ones(1, 4, 2, 8)) and len(calls) == 1
    assert calls[0]["ring"] is ring and calls[0]["sliding_window"] == 3 and calls[0]["scaling"] == 0.5


def test_a_ring_of_one_keeps_the_models_chunked_attention_mask():
    """Ring attention registered alone (library use) with Llama-4's chunked mask attends within chunks, as lstune's
    attention function does: each document cut every 4 positions (a mask that ignored them would differ)."""
    import types

    import torch

    from lstune.memory.attention_ring import RingAttention
    from lstune.memory.rotation import Ring
    from lstune.models.attention import ModelMask, lstune_attention_forward

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, 24, 8, generator=g) for h in (4, 2, 2))
    positions = torch.cat([torch.arange(10), torch.arange(14)])[None]
    key_S = torch.arange(24) - positions[0] % 4  # one value per chunk of a document

    def chunked(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (key_S[q_idx] == key_S[kv_idx])

    module = types.SimpleNamespace(is_causal=True, num_key_value_groups=2)
    ring, _ = RingAttention(Ring(1, 0, (0,)))(module, q, k, v, ModelMask(chunked, 4, chunk_first=True),
                                              position_ids=positions)
    chunks, whole_documents = (
        lstune_attention_forward(module, q, k, v, mask, position_ids=positions, backend="sdpa")[0]
        for mask in (ModelMask(chunked, 4, chunk_first=True), None))
    torch.testing.assert_close(ring, chunks, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(chunks, whole_documents, atol=1e-3)
