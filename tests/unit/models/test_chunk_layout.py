"""The chunk layout chunked attention and the SP data adapter share: chunk counts, padding, FPDT's piece order."""

from __future__ import annotations

import pytest
import torch

from lstune.models.chunk_layout import AttentionChunks, SequenceLayout, sequence_layout


def test_chunk_counts_follow_the_setting():
    assert AttentionChunks("off").count(10**6) == 1
    assert AttentionChunks("auto", 4096).count(4096) == 1  # off up to one chunk's length
    assert AttentionChunks("auto", 4096).count(4 * 4096 + 1) == 5
    assert AttentionChunks(3).count(70) == 3
    assert AttentionChunks(8).count(5) == 5  # never more chunks than tokens
    with pytest.raises(ValueError, match="auto"):
        AttentionChunks("auto")


@pytest.mark.parametrize(("seq", "sp", "chunks", "length", "count"), [
    (96, 2, AttentionChunks(3), 96, 3),
    (91, 2, AttentionChunks(3), 96, 3),  # padded to a multiple of sp·M = 6
    (91, 4, AttentionChunks(3), 96, 3),  # of 12
    (13, 2, None, 14, 1),  # unchunked: a multiple of sp
    (13, 1, AttentionChunks(3), 13, 1),  # one process: nothing to lay out
    # auto: M = ceil(local / 4096) = 3 chunks of ceil(10001 / 3) = 3334 tokens, 2 pad tokens per rank — not padded up
    # to a multiple of sp · 4096 (12288 − 10001 per rank).
    (20002, 2, AttentionChunks("auto", 4096), 20004, 3),
    (8192, 2, AttentionChunks("auto", 4096), 8192, 1),  # one chunk per rank: contiguous
])
def test_padding_is_to_equal_pieces_only(seq, sp, chunks, length, count):
    layout = sequence_layout(seq, sp, chunks)
    assert (layout.length, layout.chunks) == (length, count)
    assert layout.reordered == (count > 1)
    assert sequence_layout(layout.length, sp, chunks) == layout  # a laid-out length maps to itself
    if chunks is not None and sp > 1:  # the attention side sees the padded local length: same chunk count
        assert chunks.count(layout.local) == count


@pytest.mark.parametrize(("sp", "chunks"), [(2, 2), (2, 3), (4, 2), (4, 3), (3, 1)])
def test_gathered_chunks_are_contiguous_and_unshard_inverts_shard(sp, chunks):
    layout = SequenceLayout(sp * chunks * 5, sp, chunks)
    tokens_BS = torch.arange(layout.length)[None]
    shards = [layout.shard(tokens_BS, rank) for rank in range(sp)]
    assert torch.equal(layout.unshard([s[0] for s in shards]), tokens_BS[0])
    if not layout.reordered:
        assert torch.equal(shards[1][0], torch.arange(layout.local, 2 * layout.local))
        return
    width = layout.local // chunks
    for m in range(chunks):  # Ulysses' all-to-all of chunk m: every rank's chunk m in rank order
        gathered = torch.cat([s[0, m * width:(m + 1) * width] for s in shards])
        start, stop = layout.gathered_span(m)
        assert gathered.tolist() == list(range(start, stop))


def test_lengths_that_do_not_cut_into_equal_pieces_are_refused():
    with pytest.raises(ValueError, match="equal pieces"):
        SequenceLayout(20, 2, 3)


@pytest.mark.parametrize(("sp", "ring"), [(4, 4), (4, 2), (8, 2), (2, 2)])
def test_zigzag_ring_layout_gives_each_ring_position_pieces_r_and_2R_minus_1_minus_r(sp, ring):
    layout = sequence_layout(61, sp, None, ring)
    assert layout.length % (2 * sp) == 0 and layout.length - 61 < 2 * sp
    tokens_BS = torch.arange(layout.length)[None]
    shards = [layout.shard(tokens_BS, rank)[0] for rank in range(sp)]
    assert torch.equal(layout.unshard(shards), tokens_BS[0])
    piece = layout.length // (2 * ring)
    for r in range(ring):  # the Ulysses ranks of position r, gathered in rank order: its two pieces
        gathered = torch.cat(shards[r * layout.ulysses:(r + 1) * layout.ulysses])
        expected = [*range(r * piece, (r + 1) * piece), *range((2 * ring - 1 - r) * piece, (2 * ring - r) * piece)]
        assert gathered.tolist() == expected == layout.ring_index(r).tolist()


@pytest.mark.parametrize(("sp", "ring", "chunks"), [(4, 2, AttentionChunks(3)), (4, 4, AttentionChunks(2)),
                                                   (2, 2, AttentionChunks("auto", 16)), (8, 2, AttentionChunks(3))])
def test_chunked_ring_layout_is_the_zigzag_inside_each_chunk(sp, ring, chunks):
    """Chunked attention under a ring (issue 35): the sample is cut into M chunks and the ring's zigzag applies inside
    each, so local chunk m of ring position r's Ulysses ranks, gathered, is chunk m's pieces r and 2R−1−r."""
    layout = sequence_layout(200, sp, chunks, ring)
    count = chunks.count(-(-200 // sp))
    assert layout.chunks == count > 1 and layout.length % (2 * sp * count) == 0
    assert layout.length - 200 < 2 * sp * count and chunks.count(layout.local) == count  # the sink finds the same M
    assert sequence_layout(layout.length, sp, chunks, ring) == layout
    tokens_BS = torch.arange(layout.length)[None]
    shards = [layout.shard(tokens_BS, rank)[0] for rank in range(sp)]
    assert torch.equal(layout.unshard(shards), tokens_BS[0])
    span = layout.length // count
    for r in range(ring):
        for m in range(count):
            gathered = torch.cat([shard.chunk(count)[m] for shard in shards[r * layout.ulysses:(r + 1) * layout.ulysses]])
            expected = SequenceLayout(span, ring, 1, ring).ring_index(r) + m * span
            assert gathered.tolist() == expected.tolist()
