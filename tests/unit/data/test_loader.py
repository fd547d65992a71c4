"""The infinite, deterministic, resumable batch stream."""

from __future__ import annotations

from itertools import islice

import pytest
import torch

from lstune.data.dataset import build_dataset
from lstune.data.loader import collate, make_dataloader
from tests.unit.data._helpers import write_jsonl


class IndexDataset(torch.utils.data.Dataset):
    """Sample i carries i in every field; counts the samples actually loaded."""

    def __init__(self, n: int):
        self.n, self.loaded = n, 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        self.loaded += 1
        return {k: torch.full((3,), i) for k in ("input_ids", "position_ids", "shift_labels")}


def _stream(ds, n_batches: int, batch: int = 2, **kw) -> list[int]:
    return [int(i) for b in islice(make_dataloader(ds, batch, **kw), n_batches) for i in b["input_ids"][:, 0]]


def test_collate_stacks_into_batch_contract():
    batch = collate([IndexDataset(4)[1], IndexDataset(4)[2]])
    assert {k: tuple(v.shape) for k, v in batch.items()} == {k: (2, 3) for k in batch}
    assert batch["input_ids"][:, 0].tolist() == [1, 2]


def test_each_epoch_is_a_fresh_permutation_and_epochs_repeat_forever():
    stream = _stream(IndexDataset(5), 10, seed=0)  # 20 samples = 4 epochs
    epochs = [stream[i : i + 5] for i in range(0, 20, 5)]
    assert all(sorted(e) == list(range(5)) for e in epochs)
    assert len({tuple(e) for e in epochs}) > 1


def test_same_seed_same_stream_other_seed_other_stream():
    assert _stream(IndexDataset(7), 8, seed=3) == _stream(IndexDataset(7), 8, seed=3)
    assert _stream(IndexDataset(7), 8, seed=3) != _stream(IndexDataset(7), 8, seed=4)


def test_no_shuffle_is_the_dataset_order_repeated():
    assert _stream(IndexDataset(3), 4, seed=0, shuffle=False) == [0, 1, 2, 0, 1, 2, 0, 1]


@pytest.mark.parametrize("start", [1, 4, 7, 12])
def test_start_sample_gives_exactly_the_tail_of_the_stream(start):
    full = _stream(IndexDataset(5), 12, seed=1)
    assert _stream(IndexDataset(5), 4, seed=1, start_sample=start) == full[start : start + 8]


def test_start_sample_skips_without_loading():
    ds = IndexDataset(5)
    next(iter(make_dataloader(ds, 2, seed=0, start_sample=1_000_003)))
    assert ds.loaded == 2


def test_data_parallel_ranks_interleave_the_same_stream():
    full = _stream(IndexDataset(5), 6, seed=2, start_sample=4)
    ranks = [_stream(IndexDataset(5), 3, seed=2, start_sample=4, dp_rank=r, dp_size=2) for r in (0, 1)]
    assert full == [ranks[i % 2][i // 2] for i in range(12)]


def test_real_dataset_with_a_worker_matches_in_process(tmp_path, byte_tok):
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": "abc" * i} for i in range(1, 6)])
    ds = build_dataset(str(path), byte_tok, 12, pack=True)
    in_process = list(islice(make_dataloader(ds, 2, seed=5, start_sample=3), 3))
    in_worker = list(islice(make_dataloader(ds, 2, seed=5, start_sample=3, num_workers=1), 3))
    for a, b in zip(in_process, in_worker):
        assert all(a[k].dtype == torch.int64 and a[k].shape == (2, 12) and torch.equal(a[k], b[k]) for k in a)
