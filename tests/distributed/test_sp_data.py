"""The SP data adapter on 2 and 4 gloo processes: each SP group works through its ranks' samples one at a
time, every rank gets its own shard of the same sample, padding is transparent, and the group stops
together when any rank's loader ends."""

from __future__ import annotations

import pytest


def _sample(rank: int, k: int) -> dict:
    from tests.distributed._helpers import make_batch

    return make_batch(20 + 3 * rank + k, seed=rank * 100 + k, docs=1 + k % 2)


def _adapter_worker(rank: int, world: int, sp: int, chunks: int | None) -> list:
    from lstune.models.chunk_layout import AttentionChunks
    from lstune.parallel.dims import ParallelDims
    from lstune.parallel.sp_data import SPDataAdapter, shard_batch

    dims = ParallelDims(world, sp).build_groups()
    chunking = AttentionChunks(chunks) if chunks else None
    loader = [_sample(rank, k) for k in range(2 + (rank == 0))]  # rank 0 has one sample more
    adapter = SPDataAdapter(loader, dims, chunks=chunking)
    received = list(adapter)
    block = dims.sp_group_ranks(dims.dp_rank)
    expected = [shard_batch(_sample(src, k), sp, dims.sp_rank, chunking) for k in range(2) for src in block]
    same = len(received) == len(expected) and all(
        all(received[i][key].equal(expected[i][key]) for key in expected[i]) for i in range(len(expected))
    )
    return same, len(received)


@pytest.mark.parametrize(("world", "sp", "chunks"), [(2, 2, None), (4, 4, None), (4, 2, None), (2, 2, 3), (4, 4, 2)])
def test_each_rank_gets_its_shard_of_each_group_sample_in_rank_order(pools, world, sp, chunks):
    """Contiguous shards, or with chunked attention FPDT's pieces (shard_batch's layout, tested in unit tests)."""
    for same, n in pools[world].run(_adapter_worker, sp, chunks):
        assert same, "a rank received a different shard or order than shard_batch of the source sample"
        assert n == 2 * sp  # the extra sample on rank 0 is dropped: the group stops together
