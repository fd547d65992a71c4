"""The SP traffic and memory formulas of lstune.estimate.sequence_parallel, on hand-checkable shapes."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from lstune.estimate.metp_table import mlp_comparison
from lstune.estimate.sequence_parallel import (
    NETWORK_BYTES_PER_S,
    NVLINK_BYTES_PER_S,
    ring_buffer_bytes,
    sp_traffic,
)

# One layer, 4 q heads and 2 kv heads of 8: q 32, kv 16 wide; a gated MLP 16 → 64.
SHAPE = SimpleNamespace(layers=1, hidden=16, q_width=32, kv_width=16, heads=4, kv_heads=2, head_dim=8,
                        intermediate=64, gated=True)


def test_ulysses_alone_moves_four_all_to_alls_each_way_and_no_ring_bytes():
    t = sp_traffic(SHAPE, seq_len=1024, micro_batch=1, sp=2, ring=1, checkpointing=False)
    # 512 local tokens, (U-1)/U = 1/2 of t·(2q + 2kv) elements of 2 bytes, forward and backward.
    assert t.ulysses_bytes == 2 * (512 * (2 * 32 + 2 * 16) * 2 // 2)
    assert (t.ring_bytes, t.metp_bytes) == (0, 0)
    assert t.ulysses_s == pytest.approx(t.ulysses_bytes / NVLINK_BYTES_PER_S)


def test_the_ring_moves_its_blocks_and_their_fp32_gradients_and_crosses_nodes_past_one():
    t = sp_traffic(SHAPE, seq_len=1024, micro_batch=1, sp=16, ring=4, checkpointing=True, node_size=8)
    block = 1024 // 4 * 2 * 8  # S/R tokens × k and v of one kv head of 8 (2 heads on U = 4 ranks: replicated)
    assert t.ring_bytes == 3 * block * (2 * 3 + 4)  # 3 hops: K/V fetched in forward, its re-run, backward; fp32 dK/dV
    assert t.ring_s == pytest.approx(t.ring_bytes / NETWORK_BYTES_PER_S)
    inside = sp_traffic(SHAPE, seq_len=1024, micro_batch=1, sp=8, ring=4, node_size=8)
    assert inside.ring_s == pytest.approx(inside.ring_bytes / NVLINK_BYTES_PER_S)


def test_ring_buffers_shrink_with_the_ring_and_vanish_without_it():
    assert ring_buffer_bytes(SHAPE, seq_len=4096, micro_batch=1, sp=4, ring=1) == 0
    two, four = (ring_buffer_bytes(SHAPE, seq_len=4096, micro_batch=1, sp=r, ring=r) for r in (2, 4))
    assert four < two < 4 * four  # blocks of S/R tokens: linear; a piece's score tiles: quadratic in S/(2R)


def test_metp_holds_one_over_p_of_the_mlp_and_moves_what_zero_moves():
    """Per layer and rank. METP's shard trains beside ZeRO: fp32 master, gradient and AdamW's m, v (16 B) for 1/p of the
    MLP; ZeRO-3's partition (bf16 weight, fp32 gradient, master + m + v) plus the gathered layer and the one prefetched.
    Each moves (p−1)/p of the MLP per weight pass (forward, re-run, backward) and once for the gradients — METP Table
    1's 3·(p−1)/p in elements; METP's gradient sums travel in fp32."""
    shape = SimpleNamespace(**vars(SHAPE), experts=0, active_intermediate=64)
    c = mlp_comparison(shape, seq_len=1024, micro_batch=1, sp=4, world=4, tiles=1)
    weights = 3 * 16 * 64
    assert c.metp_weights == weights // 4 * (4 + 4 + 8)
    assert c.zero3_weights == weights // 4 * (2 + 4 + 12) + 2 * weights * 2
    assert c.metp_moved == int(3 / 4 * weights * (3 * 2 + 4)) and c.zero3_moved == int(3 / 4 * weights * 2 * 4)
    # working sets: METP's (s/p)·(I/p) step against one tile of (s/p)·I (metp_moment_bytes, the tiled-MLP terms)
    t = 1024 // 4
    assert c.metp_peak == 6 * t * 16 * 2 + 3 * t * 16 * 2 + weights // 4 * (10 * 2 + 24) // 3
    assert c.zero3_peak == t * (5 * 64 * 2 + 2 * 2 * 16)
    frozen = mlp_comparison(shape, seq_len=1024, micro_batch=1, sp=4, world=4, tiles=1, trainable=False)
    assert frozen.metp_weights == weights // 4 * 2 and frozen.zero3_weights == weights // 4 * 2 + 2 * weights * 2
    # the step's traffic says the same; frozen shards (LoRA) send no gradient sums
    moved = [sp_traffic(shape, seq_len=1024, micro_batch=1, sp=4, ring=1, metp_mlp=True, metp_trainable=trained)
             for trained in (True, False)]
    assert [t.metp_bytes for t in moved] == [c.metp_moved, frozen.metp_moved] == [int(3 / 4 * weights * 10),
                                                                               int(3 / 4 * weights * 6)]


def test_chunked_attention_under_a_ring_moves_the_same_bytes_but_does_not_overlap_them():
    """Issue 35: with attention chunks under a ring each chunk's K/V is all-gathered over the ring (and its fp32
    dK/dV reduce-scattered home) — the hops' bytes, but synchronous: never counted as hidden."""
    hops = sp_traffic(SHAPE, seq_len=1 << 20, micro_batch=1, sp=8, ring=2, attention_flops_per_s=1e9)
    gathered = sp_traffic(SHAPE, seq_len=1 << 20, micro_batch=1, sp=8, ring=2, attention_flops_per_s=1e9,
                          ring_gathered=True)
    assert gathered.ring_bytes == hops.ring_bytes > 0 and gathered.ring_s == hops.ring_s
    assert hops.ring_overlap and not gathered.ring_overlap and gathered.ring_gathered
