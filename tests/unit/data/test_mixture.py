"""Several --data sources mixed with weights: slots, determinism, resume, realised proportions."""

from __future__ import annotations

import itertools

import pytest
import torch

from lstune.data.dataset import build_dataset
from lstune.data.loader import StreamSampler, make_dataloader
from lstune.data.mixture import MixtureDataset, realised_shares, slot_counts
from lstune.data.sources import mixture_entries
from tests.unit.data._helpers import write_jsonl

SEQ = 16


@pytest.fixture
def sources(tmp_path):
    """Two sources told apart by their first byte: 'a...' (10 records) and 'b...' (3 records)."""
    a = write_jsonl(tmp_path / "a.jsonl", [{"text": f"a{i:02d}"} for i in range(10)])
    b = write_jsonl(tmp_path / "b" / "data.jsonl", [{"text": f"b{i}"} for i in range(3)])
    return str(a), str(tmp_path / "b")


def source_letter(sample, tok) -> str:
    return tok.decode(sample["input_ids"][1:2].tolist())  # after bos


def test_entries_split_weights_only_in_a_mixture():
    assert mixture_entries("builtin:passkey") == [("builtin:passkey", None)]
    assert mixture_entries("data:0.5") == [("data:0.5", None)]  # a single source is taken as named
    assert mixture_entries(["a.jsonl:0.7", "builtin:passkey:3"]) == [("a.jsonl", 0.7), ("builtin:passkey", 3.0)]
    assert mixture_entries(["a", "b/"]) == [("a", None), ("b/", None)]


def test_slot_counts_keep_every_sample_and_follow_the_weights():
    assert slot_counts([10, 3], None) == [10, 3]
    counts = slot_counts([10, 3], [0.7, 0.3])
    assert counts == [11, 5]  # epoch max(ceil(10/0.7), ceil(3/0.3)) = 15: ceil(10.5), ceil(4.5)
    big = slot_counts([1000, 100], [1, 3])
    assert big == [1000, 3000] and big[1] / sum(big) == pytest.approx(0.75)


def test_mixture_samples_are_the_sources_samples(sources, byte_tok):
    a, b = sources
    mix = build_dataset([f"{a}:0.7", f"{b}:0.3"], byte_tok, SEQ, seed=3)
    assert isinstance(mix, MixtureDataset)
    part_a, part_b = build_dataset(a, byte_tok, SEQ), build_dataset(b, byte_tok, SEQ)
    assert len(mix) == 16 and mix.counts == [11, 5]
    seen = {"a": set(), "b": set()}
    for i in range(len(mix)):
        source, local = int(mix.source_of[i]), int(mix.local_index[i])
        part = (part_a, part_b)[source]
        for key, value in mix[i].items():
            assert torch.equal(value, part[local][key])
        seen["ab"[source]].add(local)
        assert source_letter(mix[i], byte_tok) == "ab"[source]
    assert seen == {"a": set(range(10)), "b": set(range(3))}  # every sample at least once per mixture epoch


def test_summary_reports_shares_and_parts(sources, byte_tok):
    a, b = sources
    summary = build_dataset([f"{a}:0.7", f"{b}:0.3"], byte_tok, SEQ).summary()
    assert summary["samples"] == 16
    assert [s["slots"] for s in summary["sources"]] == [11, 5]
    assert f"{a} 68.8% (11 slots for its 10 samples, weight 0.7)" in summary["note"]
    assert f"{b} 31.2% (5 slots for its 3 samples, weight 0.3)" in summary["note"]
    assert summary["max_token_id"] == max(ord("b"), ord("9")) + 3


def test_unweighted_sources_are_concatenated(sources, byte_tok):
    mix = build_dataset(list(sources), byte_tok, SEQ)
    assert mix.counts == [10, 3] and mix.weights is None


def test_deterministic_and_resume_gives_the_same_following_batches(sources, byte_tok):
    a, b = sources
    build = lambda: build_dataset([f"{a}:0.6", f"{b}:0.4"], byte_tok, SEQ, seed=5)  # noqa: E731
    batch, k = 2, 7
    full = [x["input_ids"] for x in itertools.islice(make_dataloader(build(), batch, seed=5), 20)]
    again = [x["input_ids"] for x in itertools.islice(make_dataloader(build(), batch, seed=5), 20)]
    resumed = [x["input_ids"] for x in itertools.islice(make_dataloader(build(), batch, seed=5,
                                                                        start_sample=k * batch), 20 - k)]
    assert all(torch.equal(x, y) for x, y in zip(full, again))
    assert all(torch.equal(x, y) for x, y in zip(full[k:], resumed))
    other = [x["input_ids"] for x in itertools.islice(make_dataloader(build(), batch, seed=6), 20)]
    assert not all(torch.equal(x, y) for x, y in zip(full, other))


def test_realised_shares_count_the_stream(sources, byte_tok):
    a, b = sources
    mix = build_dataset([f"{a}:0.5", f"{b}:0.5"], byte_tok, SEQ, seed=1)
    consumed = 37
    loader = make_dataloader(mix, 1, seed=1)
    letters = [source_letter({"input_ids": x["input_ids"][0]}, byte_tok) for x in itertools.islice(loader, consumed)]
    shares = realised_shares(mix, StreamSampler(len(mix), seed=1), consumed)
    assert shares == {a: letters.count("a") / consumed, b: letters.count("b") / consumed}
    assert sum(shares.values()) == pytest.approx(1.0)
