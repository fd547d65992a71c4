"""Sharding helpers of the SP data adapter (single process): padding, shards, token counts, contract checks."""

from __future__ import annotations

import pytest
import torch

from lstune.errors import DataError
from lstune.models.chunk_layout import AttentionChunks
from lstune.parallel.sp_data import SPDataAdapter, check_batch, count_tokens, pad_to_multiple, shard_batch
from lstune.parallel.dims import ParallelDims


def _batch(seq: int) -> dict:
    ids = torch.arange(1, seq + 1).unsqueeze(0)
    labels = torch.cat([ids[:, 1:], torch.tensor([[-100]])], dim=1)
    return {"input_ids": ids, "position_ids": torch.arange(seq).unsqueeze(0), "shift_labels": labels}


def test_shards_keep_the_labels_shifted_on_the_full_sequence():
    """ALST 4.3: shard 0's last target is shard 1's first token, not -100."""
    batch = _batch(8)
    first, second = shard_batch(batch, 2, 0), shard_batch(batch, 2, 1)
    assert first["shift_labels"].tolist() == [[2, 3, 4, 5]]
    assert second["shift_labels"].tolist() == [[6, 7, 8, -100]]
    assert second["position_ids"].tolist() == [[4, 5, 6, 7]]


def test_padding_is_ignored_and_continues_positions():
    padded = pad_to_multiple(_batch(6), 4)
    assert padded["input_ids"].shape == (1, 8)
    assert padded["shift_labels"][0, 6:].tolist() == [-100, -100]
    assert padded["position_ids"][0, 5:].tolist() == [5, 6, 7]
    assert count_tokens(padded) == count_tokens(_batch(6)) == 5


def test_shards_cover_the_padded_sample_exactly_once():
    batch = _batch(13)
    shards = [shard_batch(batch, 4, r) for r in range(4)]
    joined = torch.cat([s["input_ids"] for s in shards], dim=1)
    assert joined[0, :13].tolist() == batch["input_ids"][0].tolist()
    assert sum(count_tokens(s) for s in shards) == count_tokens(batch)


def test_batches_without_position_ids_are_refused_with_the_fix():
    batch = _batch(4)
    del batch["position_ids"]
    with pytest.raises(DataError, match="position_ids"):
        check_batch(batch)


def test_fields_of_the_wrong_shape_are_refused():
    batch = _batch(4)
    batch["shift_labels"] = batch["shift_labels"][:, :3]
    with pytest.raises(DataError, match="shift_labels"):
        check_batch(batch)


def test_sp1_passes_batches_through():
    batches = [_batch(5), _batch(7)]
    assert list(SPDataAdapter(batches, ParallelDims(1, 1))) == batches


@pytest.mark.parametrize("sp", [2, 4])
@pytest.mark.parametrize("chunks", [2, 3])
def test_chunked_attention_shards_are_fpdt_pieces(sp, chunks):
    """The padded sample in sp·M equal pieces; rank r holds pieces r, r+sp, …: tokens, positions and the labels
    shifted on the full sequence travel together."""
    seq = 5 * sp * chunks
    batch = _batch(seq)
    piece = seq // (sp * chunks)
    for rank in range(sp):
        shard = shard_batch(batch, sp, rank, AttentionChunks(chunks))
        pieces = [rank + m * sp for m in range(chunks)]
        tokens = [t for p in pieces for t in range(p * piece, (p + 1) * piece)]
        assert shard["input_ids"][0].tolist() == [t + 1 for t in tokens]
        assert shard["position_ids"][0].tolist() == tokens
        assert shard["shift_labels"][0].tolist() == [t + 2 if t + 1 < seq else -100 for t in tokens]


def test_fpdt_padding_is_at_the_end_of_the_sample_in_the_last_pieces():
    """13 tokens on 2 ranks in 3 chunks each: padded to 18 (a multiple of 2·3, not just of 2), pieces of 3; the pad
    tokens (ignored labels, continuing positions) are global 13..17, the tail of pieces 4 and 5."""
    batch = _batch(13)
    shards = [shard_batch(batch, 2, rank, AttentionChunks(3)) for rank in range(2)]
    assert [s["position_ids"][0].tolist() for s in shards] == [[0, 1, 2, 6, 7, 8, 12, 13, 14],
                                                               [3, 4, 5, 9, 10, 11, 15, 16, 17]]
    assert shards[1]["shift_labels"][0].tolist()[3:6] == [11, 12, 13]  # global 9..11: the labels shifted across pieces
    assert shards[0]["shift_labels"][0].tolist()[-3:] == [-100] * 3  # the real last token and two pad tokens
    assert shards[1]["shift_labels"][0].tolist()[-3:] == [-100] * 3
    assert sum(count_tokens(s) for s in shards) == count_tokens(batch)


@pytest.mark.parametrize("chunks", [None, AttentionChunks("off"), AttentionChunks("auto", auto_tokens=64)])
def test_one_chunk_shards_stay_contiguous(chunks):
    """Unchunked (or one chunk for the local length: auto with 64-token chunks, 7 local tokens): padded to a
    multiple of sp only, contiguous shards as before."""
    batch = _batch(13)
    shards = [shard_batch(batch, 2, rank, chunks) for rank in range(2)]
    assert [s["position_ids"][0].tolist() for s in shards] == [list(range(7)), list(range(7, 14))]
