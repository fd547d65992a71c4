"""--eval-split: disjoint, seeded, covering; packed data held out as one contiguous run; nothing left refused."""

from __future__ import annotations

import pytest

from lstune.data.split import split_samples
from lstune.errors import DataError


class _Samples:
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return i

    def summary(self):
        return {"samples": self.n, "note": "n samples"}


@pytest.mark.parametrize("pack", [False, True])
def test_split_is_disjoint_covering_and_seeded(pack):
    train, held = split_samples(_Samples(100), 0.05, pack=pack, seed=3)
    got_train, got_held = [train[i] for i in range(len(train))], [held[i] for i in range(len(held))]
    assert len(got_held) == 5 and sorted(got_train + got_held) == list(range(100))
    again = split_samples(_Samples(100), 0.05, pack=pack, seed=3)[1]
    assert [again[i] for i in range(len(again))] == got_held
    if pack:
        assert got_held == list(range(95, 100))
    else:
        assert got_held != list(range(95, 100))
    assert held.summary()["split_samples"] == 5 and "5 of the 100 samples used for validation" in held.summary()["note"]


def test_a_split_leaving_no_training_sample_is_refused():
    with pytest.raises(DataError, match="nothing to train on"):
        split_samples(_Samples(1), 0.5, pack=False, seed=0)
