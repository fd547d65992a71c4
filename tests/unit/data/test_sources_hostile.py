"""A JSON Lines record far longer than any sample needs is refused before datasets reads it (which takes minutes
and ~22x the line's size in memory), naming the file and line."""

from __future__ import annotations

import json
import re
import time

import pytest

from lstune.data.sources import MIN_RECORD_BYTES, load_records, record_byte_limit
from lstune.errors import DataError


def test_the_limit_grows_with_the_sequence_length():
    assert record_byte_limit(256) == MIN_RECORD_BYTES
    assert record_byte_limit(16 * 2**20) == 16 * 2**20 * 64


@pytest.mark.parametrize("block_edge", [False, True])
def test_a_record_longer_than_the_limit_is_refused_naming_its_line(tmp_path, block_edge):
    path = tmp_path / "data.jsonl"
    short = json.dumps({"text": "fine"}) + "\n"
    # At the block edge, the long record starts 5,000 bytes before the reader's first 8 MiB block ends.
    before = (8 * 2**20 - 5_000) // len(short) if block_edge else 3
    path.write_text(short * before + json.dumps({"text": "y" * 20_000}) + "\n" + short)
    with pytest.raises(DataError, match=rf"data.jsonl line {before + 1} is longer than"):
        load_records(str(path), max_record_bytes=10_000)


def test_records_within_the_limit_load(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps({"text": "z" * 900}) + "\n" for _ in range(50)))
    assert len(load_records(str(path), max_record_bytes=1000).dataset) == 50


def test_a_200_mb_line_is_refused_in_seconds(tmp_path):
    path = tmp_path / "huge.jsonl"
    with open(path, "w") as f:
        f.write('{"text": "' + "a" * (70 * 2**20) + '"}\n')
    started = time.monotonic()
    with pytest.raises(DataError, match="huge.jsonl line 1 is longer than 64 MiB"):
        load_records(str(path), max_record_bytes=record_byte_limit(256))
    assert time.monotonic() - started < 10


# Beyond JSON Lines: the same bound per record in .json documents, Parquet cells, Arrow files and save_to_disk.


@pytest.mark.parametrize("layout", ["array", "lines", "pretty", "strings"])
def test_a_json_record_longer_than_the_limit_is_refused_naming_it(tmp_path, layout):
    path = tmp_path / "data.json"
    records = [{"text": "fine \\\" [{"}, {"text": "ok"}, {"text": "y" * 20_000}, {"text": "after"}]
    if layout == "array":
        path.write_text(json.dumps(records))
    elif layout == "lines":
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
    elif layout == "pretty":  # one object per record, spread over many short lines
        path.write_text("\n".join(json.dumps({"text": r["text"], "parts": list(r["text"][:5000])}, indent=1)
                                  for r in records))
    else:
        path.write_text(json.dumps([r["text"] for r in records]))
    where = "record 3 (of its top-level array)" if layout in ("array", "strings") else "record 3"
    with pytest.raises(DataError, match=rf"data.json {re.escape(where)} is longer than 10,000 bytes"):
        load_records(str(path), max_record_bytes=10_000)


def test_json_records_within_the_limit_load(tmp_path):
    path = tmp_path / "data.json"
    path.write_text(json.dumps([{"text": "z\\\"[" * 150} for _ in range(60)]))
    assert len(load_records(str(path), max_record_bytes=1000).dataset) == 60
    path.write_text(json.dumps([{"text": "z" * 1100}]))
    with pytest.raises(DataError, match="record 1 .* longer than 1,000 bytes"):
        load_records(str(path), max_record_bytes=1000)


def _parquet(path, rows):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=2)
    return path


@pytest.mark.parametrize("column", ["text", "input_ids", "messages"])
def test_a_parquet_cell_longer_than_the_limit_is_refused_naming_its_record(tmp_path, column):
    big = {"text": "y" * 20_000, "input_ids": list(range(3_000)),  # 8 bytes an id
           "messages": [{"role": "user", "content": "y" * 20_000}]}[column]
    small = {"text": "fine", "input_ids": [1, 2, 3], "messages": [{"role": "user", "content": "hi"}]}[column]
    path = _parquet(tmp_path / "data.parquet", [{column: small}] * 5 + [{column: big}] + [{column: small}])
    with pytest.raises(DataError, match=r"data.parquet record 5 \(2\d,\d{3} bytes\) is longer than "
                                        r"10,000 bytes"):
        load_records(str(path), max_record_bytes=10_000)
    assert len(load_records(str(path), max_record_bytes=30_000).dataset) == 7


def test_arrow_files_and_saved_datasets_are_bounded_per_record(tmp_path):
    from datasets import Dataset

    rows = [{"text": "fine"}] * 3 + [{"text": "y" * 20_000}]
    saved = tmp_path / "saved"
    Dataset.from_list(rows).save_to_disk(str(saved))
    with pytest.raises(DataError, match=r"save_to_disk folder .*saved: record 3 \(20,0\d\d bytes\) is longer"):
        load_records(str(saved), max_record_bytes=10_000)
    arrow = next(saved.glob("*.arrow"))
    with pytest.raises(DataError, match=r"arrow file .*\.arrow: record 3 .* is longer than 10,000 bytes"):
        load_records(str(arrow), max_record_bytes=10_000)
    folder = tmp_path / "folder"
    folder.mkdir()
    _parquet(folder / "a.parquet", [{"text": "a"}] * 4)
    _parquet(folder / "b.parquet", rows)
    with pytest.raises(DataError, match=r"folder.b\.parquet record 3 \(20,0\d\d bytes\) is longer"):
        load_records(str(folder), max_record_bytes=10_000)


def test_a_200_mb_json_document_is_refused_in_seconds(tmp_path):
    path = tmp_path / "huge.json"
    with open(path, "w") as f:
        f.write('[{"text": "short"}, {"text": "' + "a" * (70 * 2**20) + '"}]')
    started = time.monotonic()
    with pytest.raises(DataError, match=r"huge.json record 2 \(of its top-level array\) is longer than 64 MiB"):
        load_records(str(path), max_record_bytes=record_byte_limit(256))
    assert time.monotonic() - started < 10


def test_the_json_scan_does_not_depend_on_where_its_blocks_end(tmp_path, monkeypatch):
    # Escapes (runs of backslashes before quotes), brackets inside strings, nesting, whitespace: every block edge.
    from lstune.data import record_size

    tricky = ['a\\', '\\"]', '{[', 'x' * 30, '\\\\\\"', "é\"}"]
    records = [{"t": tricky, "n": {"m": [1, {"k": "]"}]}}, "plain", {"t": "y" * 120}, [["\\"]], {"u": "z"}]
    documents = {"array.json": "  \n" + json.dumps(records, indent=1),
                 "lines.json": "\n".join(json.dumps(r) for r in records) + "\n"}
    for name, text in documents.items():
        path = tmp_path / name
        path.write_text(text, encoding="utf-8")
        outcomes = set()
        for block in (1, 2, 3, 5, 7, 16, 64, 2**20):
            monkeypatch.setattr(record_size, "_BLOCK", block)
            for limit in (100, 120, 1000):
                try:
                    record_size.check_json_file(path, limit)
                    outcomes.add((block, limit, None))
                except DataError as error:
                    outcomes.add((block, limit, re.search(r"record (\d+)", str(error)).group(1)))
        by_limit = {(limit, found) for _, limit, found in outcomes}
        assert len(by_limit) == 3, (name, sorted(outcomes))  # one outcome per limit, whatever the blocks
        # Records 1 and 3 are 117 and 129 bytes on a line (more, indented in the array).
        expected = {(100, "1"), (120, "3"), (1000, None)} if name == "lines.json" else {(100, "1"), (120, "1"),
                                                                                       (1000, None)}
        assert by_limit == expected, (name, sorted(outcomes))
