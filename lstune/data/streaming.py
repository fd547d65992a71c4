"""`--data-streaming`: one source read as a `datasets.IterableDataset`, for data larger than the cache's disk.

Without streaming, `datasets` converts a source once to memory-mapped Arrow files in its cache (RAM is never the
limit; that disk is). A stream stores nothing: records are read as the run needs them (a hub dataset over HTTP,
local JSONL/JSON/Parquet/Arrow files or a save_to_disk folder from disk), then

1. shuffled in a buffer of `--data-shuffle-buffer` records seeded by --seed (`IterableDataset.shuffle`, which also
   shuffles the order of the files or shards); epoch e reshuffles with `set_epoch(e)`;
2. tokenized by the map-style path's own function (`lstune.data.records.tokenize_batch`), a few records at a time;
3. laid out as the same samples as lstune.data.dataset's layouts, in stream order: long mode, a document's first
   `seq_len` tokens (documents with no target there skipped); pack mode, documents end to end cut every
   `seq_len` tokens, positions restarting per document, cuts without a target dropped, the epoch's last one
   padded. Each epoch packs its own order.

Position and resume, as the map-style loader (lstune.data.loader): the position is one integer, the global number
of samples consumed; rank r of W takes global samples r, r + W, ... (an SP group then works through its ranks'
samples one at a time, lstune.parallel.sp_data). Resuming at sample N replays the stream from its start and drops
the first N samples: exact (the next sample is the one the uninterrupted run reads), at the cost of reading and
tokenizing those records again (no model compute). `IterableDataset.state_dict()` would skip that work but does
not save the shuffle buffer's contents, so the resumed order would differ.

Costs: every rank reads and tokenizes the whole stream and keeps its share; the length is unknown, so a run needs
--max-steps and its summary has no counts; JSON Lines records are not size-checked up front (that would read the
whole source once more).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from lstune.data.dataset import _pad_id, assemble_sample
from lstune.data.records import IGNORE, KIND_FIELDS, check_tokenizer, detect_kind, tokenize_batch
from lstune.errors import DataError

RECORDS_PER_CALL = 64  # records tokenized together (fast tokenizers batch them in Rust)


@dataclass
class StreamingSamples:
    """The samples of one streamed source. `rank_batches` is what training reads; `samples` the global stream."""

    records: Any  # datasets.IterableDataset of raw records, fields mapped
    kind: str
    tokenizer: Any
    seq_len: int
    pack: bool
    seed: int
    shuffle_buffer: int
    vocab_size: int | None
    info: dict

    def rank_batches(self, micro_batch_size: int, *, start_sample: int = 0, rank: int = 0,
                     world_size: int = 1) -> Iterator[dict]:
        """Rank `rank`'s batches of `micro_batch_size` samples from global position `start_sample` (a count of all
        ranks' samples, as lstune.data.loader.make_dataloader takes it): forever."""
        from lstune.data.loader import collate

        mine = itertools.islice(self.samples(start_sample + rank), 0, None, world_size)
        while True:
            yield collate([next(mine) for _ in range(micro_batch_size)])

    def samples(self, start: int = 0) -> Iterator[dict]:
        """The global stream from sample `start` on, epoch after epoch."""
        return itertools.islice(self._forever(), start, None)

    def summary(self) -> dict[str, Any]:
        mode = "pack" if self.pack else "long"
        fields = ", ".join(repr(f) for f in KIND_FIELDS[self.kind])
        note = (f"streaming {self.info['origin']} ({self.kind} records, fields {fields}) -> samples of "
                f"{self.seq_len} tokens ({mode} mode), tokenized on the fly; shuffle buffer "
                f"{self.shuffle_buffer} records; counts unknown until read")
        return {**self.info, "mode": mode, "seq_len": self.seq_len, "streaming": True, "note": note}

    def _forever(self) -> Iterator[dict]:
        for epoch in itertools.count():
            produced = 0
            for sample in self._epoch_samples(epoch):
                produced += 1
                yield sample
            if produced == 0:
                raise DataError(f"data source {self.info['source']}: the stream has no token to train on (no record "
                                f"with a target within its first {self.seq_len} tokens). Check the data.")

    def _epoch_samples(self, epoch: int) -> Iterator[dict]:
        records = self.records
        if self.shuffle_buffer:
            records = records.shuffle(seed=self.seed, buffer_size=self.shuffle_buffer)
        records.set_epoch(epoch)
        layout = packed_samples if self.pack else long_samples
        return layout(self._documents(records), self.seq_len, _pad_id(self.tokenizer))

    def _documents(self, records) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """(input ids, shifted labels) of each record, in stream order."""
        index = 0
        for chunk in _chunks(iter(records), RECORDS_PER_CALL):
            columns = dict.fromkeys(column for record in chunk for column in record)
            batch = {column: [record.get(column) for record in chunk] for column in columns}
            _check_kind(chunk, self.kind, index, self.info["source"])
            docs = tokenize_batch(batch, list(range(index, index + len(chunk))), kind=self.kind,
                                  tokenizer=self.tokenizer)
            for ids, labels, max_id in zip(docs["input_ids"], docs["shift_labels"], docs["max_id"]):
                if self.vocab_size is not None and max_id >= self.vocab_size:
                    raise DataError(f"--data {self.info['source']!r} has token id {max_id} (as an input id or a "
                                    f"label), but the model has a vocabulary of {self.vocab_size}; pre-tokenized "
                                    "data must come from the model's own tokenizer.")
                yield np.asarray(ids, np.int64), np.asarray(labels, np.int64)
            index += len(chunk)


def long_samples(docs, seq_len: int, pad_id: int) -> Iterator[dict]:
    """One sample per document: its first `seq_len` tokens; a document with no target there is skipped."""
    for ids_T, labels_T in docs:
        n = min(len(ids_T), seq_len)
        if (labels_T[:n] != IGNORE).any():
            yield assemble_sample([ids_T[:n]], [labels_T[:n]], [np.arange(n)], seq_len, pad_id=pad_id, pack=False)


def packed_samples(docs, seq_len: int, pad_id: int) -> Iterator[dict]:
    """Documents with a target, end to end, cut every `seq_len` tokens (a document continuing in the next sample as a
    new segment, positions from 0); a cut without a target is dropped; the last one is padded."""
    ids, labels, positions, used = [], [], [], 0
    for ids_T, labels_T in docs:
        if not (labels_T != IGNORE).any():
            continue
        start = 0
        while start < len(ids_T):
            take = min(seq_len - used, len(ids_T) - start)
            ids.append(ids_T[start : start + take])
            labels.append(labels_T[start : start + take])
            positions.append(np.arange(take))
            start, used = start + take, used + take
            if used == seq_len:
                if any((piece != IGNORE).any() for piece in labels):
                    yield assemble_sample(ids, labels, positions, seq_len, pad_id=pad_id, pack=True)
                ids, labels, positions, used = [], [], [], 0
    if used and any((piece != IGNORE).any() for piece in labels):
        yield assemble_sample(ids, labels, positions, seq_len, pad_id=pad_id, pack=True)


def open_stream(source: str, tokenizer: Any, seq_len: int, *, pack: bool = False, seed: int = 0,
                shuffle_buffer: int = 0, vocab_size: int | None = None, max_records: int | None = None,
                split: str | None = None, subset: str | None = None,
                fields: dict[str, str] | None = None) -> StreamingSamples:
    """`source` as a stream of samples (see the module doc); DataError for anything the user must fix."""
    from lstune.data.sources import check_source, field_renames, mapped_fields, record_byte_limit

    if seq_len < 2:
        raise ValueError(f"seq_len must be at least 2, got {seq_len}")
    check_source(source, split=split, subset=subset)
    if source.startswith("builtin:"):
        raise DataError(f"--data-streaming: {source} is a small file shipped with lstune; drop --data-streaming.")
    path = Path(source).expanduser()
    records, origin = (_local_stream(path, split, record_byte_limit(seq_len)) if path.exists()
                       else _hub_stream(source, split, subset))
    columns = _columns(records, source, origin)
    if fields:
        records = records.rename_columns(field_renames(columns, fields, source))
        columns = [next((f for f, c in fields.items() if c == column), column) for column in columns]
        origin = f"{origin}, fields {mapped_fields(fields)}"
    kind = detect_kind(columns)
    check_tokenizer(kind, tokenizer)
    if max_records is not None:
        records = records.take(max_records)
    info = {"source": source, "origin": origin, "kind": kind.name, "fields": list(kind.fields),
            "field_map": dict(fields or {})}
    return StreamingSamples(records, kind.name, tokenizer, seq_len, pack, seed, shuffle_buffer, vocab_size, info)


def _local_stream(path: Path, split: str | None, max_record_bytes: int):
    """A local source as an IterableDataset, after the same per-record size bound as a loaded source
    (lstune.data.sources: a JSON Lines line, a .json record, a Parquet row group, an Arrow row): one pass that
    reads a block at a time (memory-mapped for Arrow), so a record no sample can use is refused before the stream
    parses it at ~20x its size."""
    from datasets import DatasetDict, load_dataset, load_from_disk

    from lstune.data.record_size import check_rows
    from lstune.data.sources import _builder_for, _check_line_lengths, folder_files

    if path.is_dir() and ((path / "dataset_dict.json").is_file() or (path / "state.json").is_file()):
        saved = load_from_disk(str(path))
        if isinstance(saved, DatasetDict):
            if (split or "train") not in saved:
                raise DataError(f"data source {path}: the saved DatasetDict has splits {sorted(saved)} but no "
                                f"{split or 'train'!r}; pick one with --data-split.")
            saved = saved[split or "train"]
        check_rows(saved, max_record_bytes, f"save_to_disk folder {path}")
        return saved.to_iterable_dataset(num_shards=max(1, len(saved.cache_files))), f"save_to_disk folder {path}"
    if path.is_dir():
        builder, files = folder_files(path)
        origin = f"folder {path} ({len(files)} {builder} files)"
    else:
        builder, files, origin = _builder_for(path), [path], f"{_builder_for(path)} file {path}"
    _check_line_lengths(files, max_record_bytes)
    return load_dataset(builder, data_files=[str(f) for f in files], split="train", streaming=True), origin


def _hub_stream(name: str, split: str | None, subset: str | None):
    from datasets import load_dataset

    from lstune.data.sources import ACCEPTED

    split = split or "train"
    try:
        records = load_dataset(name, subset, split=split, streaming=True)
    except Exception as e:  # offline, unknown name, gated, no such split: all need the user's action
        raise DataError(f"data source {name!r} is neither a local path nor a reachable hub dataset "
                        f"({type(e).__name__}: {e}). Pass {ACCEPTED}; for a hub dataset, check the name, "
                        "--data-subset and --data-split, and that the network is reachable.") from e
    part = f"subset {subset}, split {split}" if subset else f"split {split}"
    return records, f"hub dataset {name} ({part}, streamed)"


def _columns(records, source: str, origin: str) -> list[str]:
    """The stream's columns: from its features when known, else from its first record."""
    if records.column_names:
        return list(records.column_names)
    first = next(iter(records), None)
    if first is None:
        raise DataError(f"data source {source}: {origin} has no records. Point the data source at a non-empty dataset.")
    return list(first)


def _check_kind(chunk: list[dict], kind: str, index: int, source: str) -> None:
    """DataError for a record without its kind's fields but with another kind's (a file mixing kinds: see
    lstune.data.records.check_one_kind, which checks a whole map-style dataset at once)."""
    required = KIND_FIELDS[kind]
    for offset, record in enumerate(chunk):
        if any(record.get(c) is not None for c in required):
            continue
        other = next((name for name, fields in KIND_FIELDS.items()
                      if name != kind and all(record.get(c) is not None for c in fields)), None)
        if other is not None:
            raise DataError(f"data source {source} mixes two kinds of records: record {index + offset} of the stream "
                            f"is {other}, not {kind}; lstune reads one kind per source. Put each kind in a file of "
                            "its own, or convert the records to one kind.")


def _chunks(iterator: Iterator, size: int) -> Iterator[list]:
    while chunk := list(itertools.islice(iterator, size)):
        yield chunk
