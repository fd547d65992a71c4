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
