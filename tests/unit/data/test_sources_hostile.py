"""A JSON Lines record far longer than any sample needs is refused before datasets reads it (which takes minutes
and ~22x the line's size in memory), naming the file and line."""

from __future__ import annotations

import json
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
