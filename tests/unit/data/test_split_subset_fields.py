"""--data-split, --data-subset and --data-fields: which part of a source is read, and which columns are lstune's
fields (issue 38). Local DatasetDict folders and files only; the hub's loader is replaced (no network)."""

from __future__ import annotations

import json

import pytest

from lstune.config.load import build_config
from lstune.config.parse import RECORD_FIELDS, parse_field_map
from lstune.data.dataset import build_dataset
from lstune.data.records import KIND_FIELDS, OPTIONAL_FIELDS
from lstune.data.sources import load_records
from lstune.errors import ConfigError, DataError


@pytest.fixture
def saved_dict(tmp_path):
    from datasets import Dataset, DatasetDict

    path = tmp_path / "dd"
    DatasetDict({
        "train": Dataset.from_list([{"text": f"train record {i}"} for i in range(5)]),
        "validation": Dataset.from_list([{"text": f"validation record {i}"} for i in range(3)]),
    }).save_to_disk(str(path))
    return path


@pytest.fixture
def body_file(tmp_path):
    path = tmp_path / "body.jsonl"
    path.write_text("".join(json.dumps({"body": f"document {i} " * 8, "id": i}) + "\n" for i in range(4)))
    return path


def test_a_dataset_dict_folder_reads_the_split_asked_for(saved_dict):
    assert load_records(str(saved_dict)).dataset["text"][0] == "train record 0"
    records = load_records(str(saved_dict), split="validation")
    assert records.dataset["text"] == [f"validation record {i}" for i in range(3)]
    assert "split validation" in records.origin


def test_an_unknown_split_names_the_splits_there(saved_dict):
    with pytest.raises(DataError, match=r"splits \['train', 'validation'\] but no 'test'"):
        load_records(str(saved_dict), split="test")


def test_a_file_has_no_split_or_subset_to_pick(body_file):
    with pytest.raises(DataError, match="--data-split 'validation'"):
        load_records(str(body_file), split="validation")
    with pytest.raises(DataError, match="--data-subset 'en' picks a hub dataset's subset"):
        load_records(str(body_file), subset="en")
    with pytest.raises(DataError, match="--data-split"):
        load_records("builtin:passkey", split="test")


def test_a_hub_dataset_gets_its_subset_and_split(monkeypatch):
    import datasets

    calls = []

    def fake_load_dataset(name, subset=None, *, split):
        calls.append((name, subset, split))
        return datasets.Dataset.from_list([{"text": "from the hub"}])

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    records = load_records("org/corpus", subset="wiki-en", split="validation")
    assert calls == [("org/corpus", "wiki-en", "validation")]
    assert records.origin == "hub dataset org/corpus (subset wiki-en, split validation)"
    load_records("org/corpus")
    assert calls[-1] == ("org/corpus", None, "train")


def test_fields_map_columns_and_the_summary_shows_them(body_file, byte_tok):
    records = load_records(str(body_file), fields={"text": "body"})
    assert "text" in records.dataset.column_names and "body" not in records.dataset.column_names
    dataset = build_dataset(str(body_file), byte_tok, 64, fields={"text": "body"})
    assert "'text' from column 'body'" in dataset.summary()["note"]
    with pytest.raises(DataError, match="none lstune can train on"):
        build_dataset(str(body_file), byte_tok, 64)


def test_fields_map_prompt_and_completion(tmp_path, byte_tok):
    path = tmp_path / "qa.jsonl"
    path.write_text(json.dumps({"question": "what is it", "answer": "a key"}) + "\n")
    dataset = build_dataset(str(path), byte_tok, 64, fields={"prompt": "question", "completion": "answer"})
    summary = dataset.summary()
    assert summary["kind"] == "prompt_completion"
    assert "'completion' from column 'answer'" in summary["note"]


def test_fields_refuse_a_missing_column_and_a_clash(tmp_path, body_file):
    with pytest.raises(DataError, match="has no column 'content'; its columns are body, id"):
        load_records(str(body_file), fields={"text": "content"})
    both = tmp_path / "both.jsonl"
    both.write_text(json.dumps({"text": "a", "body": "b"}) + "\n")
    with pytest.raises(DataError, match="already has a column 'text'"):
        load_records(str(both), fields={"text": "body"})
    swapped = load_records(str(both), fields={"text": "body", "body": "text"})
    assert swapped.dataset[0] == {"text": "b", "body": "a"}


def test_field_map_flag_and_recipe_forms():
    assert parse_field_map("text=body") == {"text": "body"}
    assert parse_field_map("prompt=question, completion=answer") == {"prompt": "question", "completion": "answer"}
    assert parse_field_map({"text": "body"}) == {"text": "body"}
    assert parse_field_map(["text=body"]) == {"text": "body"}
    for bad, message in (("text", "FIELD=COLUMN"), ("body=text", "not a field lstune reads"),
                         ("text=a,text=b", "twice")):
        with pytest.raises(ValueError, match=message):
            parse_field_map(bad)
    config = build_config({"data_fields": {"text": "body"}, "data_split": "validation"}, {})
    assert config.data.reading() == {"split": "validation", "subset": None, "fields": {"text": "body"}}
    with pytest.raises(ConfigError, match="--data-fields"):
        build_config({}, {"data_fields": "words=body"})


def test_the_config_knows_every_record_field_the_data_layer_reads():
    data_fields = {f for fields in KIND_FIELDS.values() for f in fields}
    data_fields |= {f for fields in OPTIONAL_FIELDS.values() for f in fields}
    assert set(RECORD_FIELDS) == data_fields


def test_a_source_larger_than_the_cache_disk_is_refused_with_its_size(body_file, monkeypatch):
    """Sources are memory-mapped (RAM is no limit), but datasets converts them into its cache first: a source
    larger than that disk's free space is refused, stating both sizes, before any conversion."""
    import shutil
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**6, 10**6 - 100, 100))
    size = body_file.stat().st_size
    with pytest.raises(DataError, match=rf"is {size} bytes: datasets converts it once .* 100 bytes is free "
                                        r"there\. Point HF_DATASETS_CACHE"):
        load_records(str(body_file))
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**12, 0, 10**12))
    assert len(load_records(str(body_file)).dataset) == 4
