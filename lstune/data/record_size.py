"""One record's size, bounded in every local format as in JSON Lines (sources.record_byte_limit).

- `.json` files: each record's bytes found by a scan of the file's structure in 8 MiB blocks (memory: one block),
  before datasets reads it (which reads a JSON array whole, ~10-20x its size in memory, and a JSON document spread
  over lines as one record). A record is an item of a top-level array, else a top-level value (JSON Lines, or
  one document).
- Parquet files: each row's bytes as stored (text and list lengths), read a column of a row group at a time,
  only in row groups larger than the limit (the file's metadata tells), before datasets reads the file (~4x a
  huge cell's size in memory).
- Arrow files, save_to_disk folders: each row's bytes on the memory-mapped table datasets made (no value read).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np

from lstune.errors import DataError

_BLOCK = 8 * 2**20
# What changes the structure: quotes, backslashes (the byte after one is never structural), brackets and braces.
_STRUCTURE = re.compile(rb'["\\\[\]{}]')
_FIRST = re.compile(rb"[^\s\xef\xbb\xbf]")  # the first byte that is not whitespace or a UTF-8 BOM


def size_words(limit: int) -> str:
    """`limit` bytes as a message says it (64 MiB, 10,000 bytes)."""
    return f"{limit / 2**20:,.0f} MiB" if limit >= 2**20 and limit % 2**20 == 0 else f"{limit:,} bytes"


def _too_long(where: str, limit: int) -> DataError:
    return DataError(
        f"{where} is longer than {size_words(limit)}, more than a sample of this --seq-len can use (lstune keeps "
        "its first --seq-len tokens, and reading such a record takes minutes and many times its size in memory). "
        "Split the record into documents, or shorten it.")


def check_json_file(path: Path, limit: int) -> None:
    """DataError naming the first record of JSON file `path` longer than `limit` bytes (none can be in a file no
    longer than that)."""
    if path.stat().st_size <= limit:
        return
    depth, in_string, skip, opened_at, number, offset = 0, False, -1, None, 0, 0
    in_array = None
    with open(path, "rb") as f:
        while block := f.read(_BLOCK):
            if in_array is None:  # the first byte that is not whitespace tells an array from top-level values
                first = _FIRST.search(block)
                if first is None:
                    offset += len(block)
                    continue
                in_array = block[first.start():first.start() + 1] == b"["
                record_depth = 1 if in_array else 0
            for match in _STRUCTURE.finditer(block):
                at = offset + match.start()
                if opened_at is not None and at - opened_at > limit:
                    raise _too_long(f"{path} record {number}" + (" (of its top-level array)" if in_array else ""),
                                    limit)
                if at == skip:
                    continue
                char = match.group()
                if in_string:
                    if char == b"\\":
                        skip = at + 1
                    elif char == b'"':
                        in_string = False
                        if depth == record_depth:
                            opened_at = None
                elif char == b'"':
                    in_string = True
                    if depth == record_depth:
                        opened_at, number = at, number + 1
                elif char in (b"[", b"{"):
                    if depth == record_depth:
                        opened_at, number = at, number + 1
                    depth += 1
                elif char in (b"]", b"}"):
                    depth -= 1
                    if depth == record_depth:
                        opened_at = None
            if opened_at is not None and offset + len(block) - opened_at > limit:
                raise _too_long(f"{path} record {number}" + (" (of its top-level array)" if in_array else ""), limit)
            offset += len(block)


def check_parquet_file(path: Path, limit: int) -> None:
    """DataError naming the first record of Parquet file `path` longer than `limit` bytes, before datasets reads
    it: only a row group larger than the limit can hold one, and it is read one column at a time (memory: about
    that column's size)."""
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
    except Exception:  # noqa: BLE001 - not Parquet: datasets' reader reports it, with the file
        return
    first_row = 0
    for group in range(parquet.metadata.num_row_groups):
        meta = parquet.metadata.row_group(group)
        if meta.total_byte_size > limit:
            sizes = np.zeros(meta.num_rows, dtype=np.int64)
            for column in parquet.schema_arrow.names:
                table = parquet.read_row_group(group, columns=[column])
                start = 0
                for chunk in table.column(0).chunks:
                    sizes[start:start + len(chunk)] += row_bytes(chunk)
                    start += len(chunk)
                del table
            over = np.flatnonzero(sizes > limit)
            if len(over):
                raise _too_long(f"{path} record {first_row + int(over[0])} ({int(sizes[over[0]]):,} bytes)", limit)
        first_row += meta.num_rows


def check_rows(dataset: Any, limit: int, origin: str) -> None:
    """DataError naming the first row of `dataset` (a datasets.Dataset on Arrow) whose values take more than
    `limit` bytes."""
    table = dataset.data.table
    if table.nbytes <= limit:
        return
    sizes = np.zeros(table.num_rows, dtype=np.int64)
    for column in table.columns:
        start = 0
        for chunk in column.chunks:
            sizes[start:start + len(chunk)] += row_bytes(chunk)
            start += len(chunk)
    over = np.flatnonzero(sizes > limit)
    if len(over):
        raise _too_long(f"{origin}: record {int(over[0])} ({int(sizes[over[0]]):,} bytes)", limit)


def row_bytes(array: Any) -> np.ndarray:
    """The bytes of each row of a pyarrow Array: text and binary lengths, list items (recursively), struct
    fields; fixed-width values their width. Read from lengths and offsets: no value is copied."""
    import pyarrow as pa

    kind = array.type
    if len(array) == 0:
        return np.zeros(0, dtype=np.int64)
    if pa.types.is_string(kind) or pa.types.is_binary(kind) or pa.types.is_large_string(kind) \
            or pa.types.is_large_binary(kind):
        import pyarrow.compute as pc

        return pc.binary_length(array).fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
    if pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_map(kind):
        offsets = np.asarray(array.offsets, dtype=np.int64)
        values = array.values
        inner = row_bytes(values.slice(int(offsets[0]), int(offsets[-1] - offsets[0])))
        summed = np.concatenate([[0], np.cumsum(inner)])
        return summed[offsets[1:] - offsets[0]] - summed[offsets[:-1] - offsets[0]]
    if pa.types.is_fixed_size_list(kind):
        inner = row_bytes(array.flatten())
        return inner.reshape(len(array), kind.list_size).sum(axis=1) if kind.list_size else np.zeros(len(array), np.int64)
    if pa.types.is_struct(kind):
        total = np.zeros(len(array), dtype=np.int64)
        for field in array.flatten():
            total += row_bytes(field)
        return total
    width = getattr(kind, "bit_width", None)
    if isinstance(width, int) and width > 0:
        return np.full(len(array), max(width // 8, 1), dtype=np.int64)
    return np.full(len(array), array.nbytes // len(array), dtype=np.int64)  # other types: their mean
