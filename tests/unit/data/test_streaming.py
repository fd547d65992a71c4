"""--data-streaming (lstune.data.streaming): the same samples as the map-style dataset, shuffled by a seeded buffer,
shared among ranks, resumed exactly; hub datasets too large for the cache disk refused with their sizes."""

from __future__ import annotations

import itertools
import json
from collections import namedtuple

import numpy as np
import pytest
import torch

from lstune.config.schema import TrainConfig
from lstune.data.dataset import build_dataset
from lstune.data.streaming import open_stream, packed_samples
from lstune.errors import DataError

WORDS = "hello world how are you fine thanks the pass key is what".split()


@pytest.fixture
def corpus(tmp_path):
    """40 records of 0 to 30 words (some empty: skipped), under the column `body`."""
    rng = np.random.default_rng(0)
    path = tmp_path / "corpus.jsonl"
    lines = [json.dumps({"body": " ".join(rng.choice(WORDS, size=int(rng.integers(0, 31))))}) for _ in range(40)]
    path.write_text("\n".join(lines) + "\n")
    return path


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _stream(corpus, tok, **kwargs):
    options = dict(seq_len=16, pack=False, seed=3, shuffle_buffer=0, fields={"text": "body"})
    options.update(kwargs)
    seq_len = options.pop("seq_len")
    return open_stream(str(corpus), tok, seq_len, **options)


def test_long_mode_gives_the_map_style_samples_in_stream_order(corpus, word_tok):
    mapped = build_dataset(str(corpus), word_tok, 16, fields={"text": "body"})
    streamed = list(itertools.islice(_stream(corpus, word_tok).samples(), len(mapped)))
    assert all(_same(streamed[i], mapped[i]) for i in range(len(mapped)))
    assert len(mapped) < 40  # the empty records were skipped by both


def test_pack_mode_gives_the_map_style_samples_for_the_same_document_order(corpus, word_tok):
    """The map-style dataset packs documents in a seeded order; packing that order as a stream gives its samples."""
    mapped = build_dataset(str(corpus), word_tok, 16, pack=True, seed=5, fields={"text": "body"})
    docs = mapped._docs
    order = [(np.asarray(docs[int(d)]["input_ids"], np.int64), np.asarray(docs[int(d)]["shift_labels"], np.int64))
             for d in mapped._layout.docs]
    streamed = list(packed_samples(iter(order), 16, pad_id=0))
    assert len(streamed) == len(mapped) > 5
    assert all(_same(streamed[i], mapped[i]) for i in range(len(mapped)))


def test_the_shuffle_is_seeded_and_each_epoch_reshuffles(corpus, word_tok):
    def first(seed, n=60):
        return [s["input_ids"].tolist() for s in itertools.islice(
            _stream(corpus, word_tok, seed=seed, shuffle_buffer=8).samples(), n)]

    unshuffled = [s["input_ids"].tolist() for s in itertools.islice(_stream(corpus, word_tok).samples(), 60)]
    assert first(3) == first(3)
    assert first(3) != first(4) and first(3) != unshuffled
    epoch = len(build_dataset(str(corpus), word_tok, 16, fields={"text": "body"}))  # samples per epoch
    both = first(3, 2 * epoch)
    one, two = both[:epoch], both[epoch:]
    assert sorted(one) == sorted(two) and one != two


@pytest.mark.parametrize("pack", [False, True])
def test_ranks_share_the_global_stream_and_a_resume_continues_it_exactly(corpus, word_tok, pack):
    """Rank r of W takes global samples r, r + W, ...; resuming at a sample count (past an epoch's end here)
    gives the batches the uninterrupted run reads next."""
    stream = _stream(corpus, word_tok, pack=pack, shuffle_buffer=8)
    world, micro = 2, 3
    glob = list(itertools.islice(stream.samples(), 120))
    ranks = [list(itertools.islice(stream.rank_batches(micro, rank=r, world_size=world), 20)) for r in range(world)]
    for r in range(world):
        for b, batch in enumerate(ranks[r][:3]):
            for i in range(micro):
                sample = {k: v[i] for k, v in batch.items()}
                assert _same(sample, glob[(b * micro + i) * world + r])
    done = 7  # micro-batches per rank before the "checkpoint": 42 samples, past the first epoch
    for r in range(world):
        resumed = stream.rank_batches(micro, start_sample=done * micro * world, rank=r, world_size=world)
        for expected, got in zip(ranks[r][done:], itertools.islice(resumed, 20 - done)):
            assert _same(expected, got)


def test_max_records_fields_and_the_summary(corpus, word_tok):
    stream = _stream(corpus, word_tok, max_records=3)
    docs = [json.loads(line)["body"] for line in corpus.read_text().splitlines()[:3]]
    samples = list(itertools.islice(stream.samples(), 6))
    expected = sum(1 for d in docs if d)
    assert [s["input_ids"].tolist() for s in samples[:expected]] == \
        [s["input_ids"].tolist() for s in samples[expected : 2 * expected]]  # epoch two: the same 3 records
    note = stream.summary()["note"]
    assert "fields text=body" in note and "shuffle buffer" in note and stream.summary()["streaming"]


def test_errors_while_streaming(tmp_path, word_tok):
    ids = tmp_path / "ids.jsonl"
    ids.write_text(json.dumps({"input_ids": [1, 2, 999]}) + "\n")
    with pytest.raises(DataError, match="token id 999 .* vocabulary of 50"):
        next(open_stream(str(ids), word_tok, 8, vocab_size=50).samples())
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text(json.dumps({"text": "hello"}) + "\n" + json.dumps({"prompt": "a", "completion": "b"}) + "\n")
    with pytest.raises(DataError, match="mixes two kinds of records: record 1"):
        list(itertools.islice(open_stream(str(mixed), word_tok, 8).samples(), 2))
    empty = tmp_path / "empty.jsonl"
    empty.write_text(json.dumps({"text": ""}) + "\n")
    with pytest.raises(DataError, match="no token to train on"):
        next(open_stream(str(empty), word_tok, 8).samples())
    with pytest.raises(DataError, match="drop --data-streaming"):
        open_stream("builtin:passkey", word_tok, 8)


def test_a_saved_datasetdict_split_streams(tmp_path, word_tok):
    import datasets

    datasets.DatasetDict({"train": datasets.Dataset.from_list([{"text": "hello world"}]),
                          "test": datasets.Dataset.from_list([{"text": "fine thanks"}])}).save_to_disk(tmp_path / "dd")
    sample = next(open_stream(str(tmp_path / "dd"), word_tok, 8, split="test").samples())
    assert word_tok.decode(sample["input_ids"][:3]) == "<s> fine thanks"


def test_a_hub_dataset_is_loaded_as_a_stream(monkeypatch, word_tok):
    import datasets

    calls = []

    def fake_load_dataset(name, subset=None, *, split, streaming=False):
        calls.append((name, subset, split, streaming))
        return datasets.Dataset.from_list([{"body": "hello world"}]).to_iterable_dataset()

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    stream = open_stream("org/corpus", word_tok, 8, subset="en", fields={"text": "body"})
    assert calls == [("org/corpus", "en", "train", True)]
    assert next(stream.samples())["input_ids"][:3].tolist() == word_tok("hello world")["input_ids"][:3]


def test_a_hub_dataset_larger_than_the_cache_disk_is_refused_before_download(monkeypatch, tmp_path):
    import shutil
    import types

    import datasets

    from lstune.data.sources import load_records

    info = types.SimpleNamespace(download_size=3 * 2**40, dataset_size=5 * 2**40)
    builder = types.SimpleNamespace(info=info, cache_dir=str(tmp_path / "not-prepared"))
    monkeypatch.setattr(datasets, "load_dataset_builder", lambda name, subset=None: builder)
    loads = []
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: loads.append(a) or
                        datasets.Dataset.from_list([{"text": "hello"}]))
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(2**41, 2**40, 2**40))
    with pytest.raises(DataError, match=r"'org/big' \(subset en\) is 3072.0 GiB to download and 5120.0 GiB as Arrow "
                                        r"files .* 1024.0 GiB is free there\. Add --data-streaming"):
        load_records("org/big", subset="en")
    assert loads == []
    builder.cache_dir = str(tmp_path)  # prepared by an earlier load: it needs no more room
    assert len(load_records("org/big").dataset) == 1
    builder.cache_dir = str(tmp_path / "not-prepared")
    info.download_size, info.dataset_size = None, None  # sizes not stated: nothing to check, the load goes on
    assert len(load_records("org/big").dataset) == 1
    info.download_size, info.dataset_size = 2**30, 2**30
    assert len(load_records("org/big").dataset) == 1


def _config(**data) -> TrainConfig:
    config = TrainConfig()
    for key, value in data.items():
        section = "optim" if key == "max_steps" else "data"
        setattr(getattr(config, section), key, value)
    return config


def test_what_streaming_refuses_before_anything_loads():
    streaming = dict(source="a.jsonl", data_streaming=True)
    assert _config(**streaming).problems() == []
    assert "needs --max-steps" in _config(**streaming).training_problems()[0]
    assert _config(**streaming, max_steps=10).training_problems() == []
    assert "mixture of streams" in " ".join(_config(**{**streaming, "source": ["a.jsonl:1", "b.jsonl:1"]}).problems())
    assert "builtin:" in " ".join(_config(**{**streaming, "source": "builtin:passkey"}).problems())
    assert "--eval-data SOURCE" in " ".join(_config(**streaming, eval_split=0.1).problems())
    assert _config(**streaming, eval_data="b.jsonl").problems() == []
    assert "add --data-streaming" in " ".join(_config(source="a.jsonl", data_shuffle_buffer=10).problems())


@pytest.mark.parametrize("layout", ["jsonl", "json", "parquet", "saved"])
def test_a_record_no_sample_can_use_is_refused_before_the_stream_parses_it(tmp_path, word_tok, monkeypatch, layout):
    """The bound a loaded source gets (lstune.data.sources.record_byte_limit) holds for a streamed one too (issue 37):
    one record over it is refused with its place before datasets parses it; the same source under it streams."""
    import datasets

    from lstune.data import sources

    monkeypatch.setattr(sources, "record_byte_limit", lambda seq_len: 10_000)
    rows = [{"text": "fine thanks"}] * 3 + [{"text": "y" * 20_000}]
    table = datasets.Dataset.from_list(rows)
    path = {"jsonl": tmp_path / "d.jsonl", "json": tmp_path / "d.json", "parquet": tmp_path / "d.parquet",
            "saved": tmp_path / "saved"}[layout]
    if layout == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif layout == "json":
        path.write_text(json.dumps(rows))
    elif layout == "parquet":
        table.to_parquet(str(path))
    else:
        table.save_to_disk(str(path))
    with pytest.raises(DataError, match="is longer than .*more than a sample of this --seq-len can use"):
        open_stream(str(path), word_tok, 8)
    monkeypatch.setattr(sources, "record_byte_limit", lambda seq_len: 40_000)
    assert next(open_stream(str(path), word_tok, 8).samples())["input_ids"].numel() == 8
