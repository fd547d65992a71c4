"""Sharding helpers of the SP data adapter (single process): padding, shards, token counts, contract checks."""

from __future__ import annotations

import pytest
import torch

from lstune.errors import DataError
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
