"""Every accepted source format, and each DataError a bad source gives."""

from __future__ import annotations

import json

import pytest

from lstune.data.sources import load_records
from lstune.errors import DataError
from tests.unit.data._helpers import write_jsonl

RECORDS = [{"text": "first"}, {"text": "second"}, {"text": "third"}]


def _texts(source, **kw) -> list[str]:
    return list(load_records(str(source), **kw).dataset["text"])


def _dataset():
    from datasets import Dataset

    return Dataset.from_list(RECORDS)


def test_jsonl(tmp_path):
    assert _texts(write_jsonl(tmp_path / "d.jsonl", RECORDS)) == ["first", "second", "third"]


def test_json_as_a_list_of_records_and_as_json_lines(tmp_path):
    (tmp_path / "list.json").write_text(json.dumps(RECORDS))
    write_jsonl(tmp_path / "lines.json", RECORDS)
    assert _texts(tmp_path / "list.json") == _texts(tmp_path / "lines.json") == ["first", "second", "third"]


def test_parquet(tmp_path):
    _dataset().to_parquet(str(tmp_path / "d.parquet"))
    assert _texts(tmp_path / "d.parquet") == ["first", "second", "third"]


def test_arrow_ipc_file_and_stream(tmp_path):
    import pyarrow as pa

    table = pa.Table.from_pylist(RECORDS)
    for name, writer in [("file.arrow", pa.ipc.new_file), ("stream.arrow", pa.ipc.new_stream)]:
        with pa.OSFile(str(tmp_path / name), "wb") as sink, writer(sink, table.schema) as w:
            w.write_table(table)
        assert _texts(tmp_path / name) == ["first", "second", "third"]


def test_save_to_disk_folder_is_read_and_left_untouched(tmp_path):
    _dataset().save_to_disk(str(tmp_path / "saved"))
    before = sorted(p.name for p in (tmp_path / "saved").iterdir())
    from lstune.data.dataset import build_dataset
    from lstune.data.tokenizer import ByteTokenizer

    build_dataset(str(tmp_path / "saved"), ByteTokenizer(), 16)  # tokenizes via map: cache goes elsewhere
    assert sorted(p.name for p in (tmp_path / "saved").iterdir()) == before
    assert load_records(str(tmp_path / "saved")).origin.startswith("save_to_disk folder")


def test_saved_dataset_dict_uses_the_train_split(tmp_path):
    from datasets import Dataset, DatasetDict

    DatasetDict({"train": _dataset(), "test": Dataset.from_list([{"text": "held out"}])}).save_to_disk(
        str(tmp_path / "dd")
    )
    assert _texts(tmp_path / "dd") == ["first", "second", "third"]


def test_saved_dataset_dict_without_train_names_its_splits(tmp_path):
    from datasets import DatasetDict

    DatasetDict({"validation": _dataset()}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(DataError, match=r"splits \['validation'\] but no 'train'"):
        load_records(str(tmp_path / "dd"))


def test_folder_of_files_recursive_sorted_skipping_hidden_and_empty(tmp_path):
    write_jsonl(tmp_path / "b" / "2.jsonl", RECORDS[2:])
    write_jsonl(tmp_path / "a.jsonl", RECORDS[:2])
    write_jsonl(tmp_path / ".hidden" / "x.jsonl", [{"text": "hidden"}])
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "README.md").write_text("not data")
    records = load_records(str(tmp_path))
    assert list(records.dataset["text"]) == ["first", "second", "third"]
    assert records.origin == f"folder {tmp_path} (2 json files)"


def test_max_records_keeps_the_first(tmp_path):
    assert _texts(write_jsonl(tmp_path / "d.jsonl", RECORDS), max_records=2) == ["first", "second"]


def test_builtin_passkey():
    records = load_records("builtin:passkey")
    assert len(records.dataset) == 64 and "The pass key is" in records.dataset[0]["text"]
    answers = load_records("builtin:passkey-answer").dataset
    assert len(answers) == 64 and answers[0]["prompt"] + answers[0]["completion"] == records.dataset[0]["text"]
    held = load_records("builtin:passkey-eval").dataset
    assert len(held) == 16 and {"prompt", "completion"} <= set(held.column_names)


def _file(folder, name: str, content: str) -> str:
    (folder / name).write_text(content)
    return str(folder / name)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda p: str(p / "missing.jsonl"), "no such file or folder"),
        (lambda p: "./nowhere/data", "no such file or folder"),
        (lambda p: _file(p, "e.jsonl", ""), "the file is empty"),
        (lambda p: _file(p, "z.json", "[]"), "no records"),
        (lambda p: _file(p, "d.csv", "text\na\n"), r"unsupported file type '\.csv'"),
        (lambda p: _file(p, "bad.jsonl", "{not json\n"), "bad.jsonl line 1 is not valid JSON"),
        (lambda p: str(p), "no .jsonl/.json/.parquet/.arrow files"),
        (lambda p: _file(p, "e.jsonl", "") and str(p), "only empty data files"),
        (lambda p: "builtin:nope", "no such built-in dataset; available: builtin:passkey"),
    ],
)
def test_bad_sources_raise_data_error_with_the_fix(tmp_path, make, message):
    with pytest.raises(DataError, match=message):
        load_records(make(tmp_path))


def test_mixed_formats_in_a_folder(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", RECORDS)
    _dataset().to_parquet(str(tmp_path / "b.parquet"))
    with pytest.raises(DataError, match=r"mixes formats \(json, parquet\)"):
        load_records(str(tmp_path))


def test_zero_records_parquet(tmp_path):
    from datasets import Dataset

    Dataset.from_dict({"text": []}).to_parquet(str(tmp_path / "z.parquet"))
    with pytest.raises(DataError, match="no records"):
        load_records(str(tmp_path / "z.parquet"))


def test_unreachable_hub_name_says_it_is_neither_local_nor_reachable(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(DataError, match="neither a local path nor a reachable hub dataset.*download it"):
        load_records("nobody-lstune-test/no-such-dataset")
