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


def _mixture(tmp_path, byte_tok, pack, sizes=(20, 4)):
    from lstune.data.dataset import build_dataset
    from tests.unit.data._helpers import write_jsonl

    paths = [write_jsonl(tmp_path / f"{letter}.jsonl", [{"text": f"{letter} record {i}"} for i in range(n)])
             for letter, n in zip("ab", sizes)]
    return build_dataset([f"{p}:0.5" for p in paths], byte_tok, 32, pack=pack, seed=42)


@pytest.mark.parametrize("pack", [False, True])
def test_a_weighted_mixture_is_split_per_source_so_no_validation_sample_is_trained_on(tmp_path, byte_tok, pack):
    from lstune.data.mixture import MixtureDataset

    mix = _mixture(tmp_path, byte_tok, pack)
    train, held = split_samples(mix, 0.25, pack=pack, seed=42)
    key = lambda s: tuple(s["input_ids"].tolist())  # noqa: E731
    trained = {key(train[i]) for i in range(len(train))}
    validated = [key(held[i]) for i in range(len(held))]
    assert not trained & set(validated) and len(set(validated)) == len(validated)
    # Each source holds out ceil(0.25 x its own samples); the training mixture keeps the weights over the rest.
    sizes = [len(part) for part in mix.parts]
    assert [len(p) for p in held.parts] == [-(-n // 4) for n in sizes]
    assert isinstance(train, MixtureDataset) and train.weights == mix.weights
    assert [len(p) for p in train.parts] == [n - -(-n // 4) for n in sizes]
    assert set(held.source_of.tolist()) == {0, 1}
    assert f"{len(held)} samples used for validation, each once" in held.summary()["note"]
    _, again = split_samples(mix, 0.25, pack=pack, seed=42)
    assert [key(again[i]) for i in range(len(again))] == validated


def test_a_mixtures_validation_samples_are_interleaved_so_a_prefix_keeps_the_proportions(tmp_path, byte_tok):
    _, held = split_samples(_mixture(tmp_path, byte_tok, False, sizes=(16, 4)), 0.25, pack=False, seed=0)
    assert held.source_of.tolist() == [0, 0, 1, 0, 0]


def test_a_mixture_source_too_small_to_split_is_named(tmp_path, byte_tok):
    with pytest.raises(DataError, match=r"--eval-split 0.1 of the 1 samples of --data .*b\.jsonl would leave nothing"):
        split_samples(_mixture(tmp_path, byte_tok, False, sizes=(20, 1)), 0.1, pack=False, seed=0)
