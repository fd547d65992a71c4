"""Training samples of exactly `seq_len` tokens, in one of two modes.

- long (default): each document is one sample, truncated to `seq_len` or right-padded;
  `position_ids = arange(seq_len)` (padding after the last real token is invisible to the real
  tokens under causal attention, and its labels are -100).
- pack: documents are laid end to end in a stream cut into `seq_len` windows; `position_ids`
  restart at 0 at each document, and a document that does not fit the room left continues in the
  next sample as a new segment (positions restarting at 0). The last sample is padded, the pad
  run getting its own positions from 0, so it reads as one more (ignored) document. A cut of the
  stream with no loss-carrying token (the middle of a prompt longer than `seq_len`, a document's
  last token alone) is dropped, as long mode drops a document with no target in its first
  `seq_len` tokens: a sample must have something to learn (the summary counts them).

Labels come pre-shifted per document (see `records.py`), so a sample is plain slicing: a
document's last token has target -100, and a token whose document goes on past the cut keeps its
real target. Samples are assembled on access from the memory-mapped tokenized documents, so the
dataset costs O(documents) RAM for its index, never O(tokens).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import numpy as np
import torch

from lstune.data.records import (
    IGNORE,
    check_one_kind,
    check_tokenizer,
    detect_kind,
    document_features,
    tokenize_batch,
)
from lstune.data.sources import load_records, record_byte_limit
from lstune.errors import DataError

if TYPE_CHECKING:
    from datasets import Dataset

# Raw bytes of records tokenized per `map` batch: large enough to amortise the per-batch cost,
# small enough that a batch of million-token documents stays well under a GB of RAM.
MAP_BATCH_BYTES = 4 * 2**20
MAP_MAX_BATCH = 1000
# Per-document statistics the layouts read (records.document_features).
STAT_COLUMNS = ["length", "n_targets", "first_target", "last_target", "max_id"]
# Documents whose labels are read at once while finding the packed samples with a target.
LABEL_READ_BATCH = 64
# Bumped whenever the tokenized layout changes, so stale caches are never reused.
CACHE_VERSION = 3


@dataclass(frozen=True)
class Segment:
    """Tokens [start, stop) of document `doc`, placed next in a sample."""

    doc: int
    start: int
    stop: int


class LongContextDataset(torch.utils.data.Dataset):
    """Map-style dataset: `ds[i]` is a dict of 1-D LongTensors `input_ids`, `position_ids`,
    `shift_labels`, each of length `seq_len`. Build it with `build_dataset`."""

    def __init__(self, docs: Dataset, seq_len: int, *, pack: bool, pad_id: int, seed: int, info: dict):
        self.seq_len = seq_len
        self.pack = pack
        self.pad_id = pad_id
        self._docs = docs.with_format("numpy", columns=["input_ids", "shift_labels"])
        stats = docs.select_columns(STAT_COLUMNS).with_format("numpy")[:]
        self._layout = _PackedLayout(stats, seq_len, seed, self._labels) if pack else _LongLayout(stats, seq_len)
        if len(self._layout) == 0:
            raise DataError(_no_usable_tokens_message(info, seq_len))
        self._summary = {**info, **self._layout.summary(), "max_token_id": int(stats["max_id"].max())}
        self._summary["note"] = describe(self._summary)

    def __len__(self) -> int:
        return len(self._layout)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not -len(self) <= index < len(self):
            raise IndexError(f"sample {index} out of range for {len(self)} samples")
        segments = self._layout.segments(index % len(self))
        rows = self._docs[[s.doc for s in segments]]
        ids, labels, positions = [], [], []
        for s, ids_T, labels_T in zip(segments, rows["input_ids"], rows["shift_labels"]):
            ids.append(ids_T[s.start : s.stop])
            labels.append(labels_T[s.start : s.stop])
            positions.append(np.arange(s.stop - s.start))
        return self._assemble(ids, labels, positions)

    def summary(self) -> dict[str, Any]:
        """What was read and how it became samples; `note` says it in one sentence for the CLI."""
        return dict(self._summary)

    def _labels(self, docs: list[int]) -> list[np.ndarray]:
        return list(self._docs[docs]["shift_labels"])

    def _assemble(self, ids: list, labels: list, positions: list) -> dict[str, torch.Tensor]:
        return assemble_sample(ids, labels, positions, self.seq_len, pad_id=self.pad_id, pack=self.pack)


def assemble_sample(ids: list, labels: list, positions: list, seq_len: int, *, pad_id: int,
                    pack: bool) -> dict[str, torch.Tensor]:
    """A sample from its segments' pieces, right-padded to `seq_len` (shared with lstune.data.streaming)."""
    pad = seq_len - sum(len(p) for p in positions)
    if pad:
        ids.append(np.full(pad, pad_id))
        labels.append(np.full(pad, IGNORE))
        # Long mode keeps one position run over the sample; in pack mode the pad run is a
        # segment of its own, so document boundaries derived from positions stay exact.
        start = 0 if pack else seq_len - pad
        positions.append(np.arange(start, start + pad))
    return {
        "input_ids": torch.from_numpy(np.concatenate(ids).astype(np.int64)),
        "position_ids": torch.from_numpy(np.concatenate(positions).astype(np.int64)),
        "shift_labels": torch.from_numpy(np.concatenate(labels).astype(np.int64)),
    }


class _LongLayout:
    """One usable document per sample: its first `seq_len` tokens."""

    def __init__(self, stats: dict[str, np.ndarray], seq_len: int):
        self.seq_len = seq_len
        lengths = stats["length"]
        # A document whose first target lies past the cut would give a sample with nothing to learn.
        usable = (stats["n_targets"] > 0) & (stats["first_target"] < seq_len)
        self.docs = np.flatnonzero(usable)
        self.kept_tokens = np.minimum(lengths[self.docs], seq_len)
        self.truncated = lengths[self.docs] - self.kept_tokens
        self.skipped_empty = int((stats["n_targets"] == 0).sum())
        self.skipped_late = int(len(lengths) - len(self.docs) - self.skipped_empty)

    def __len__(self) -> int:
        return len(self.docs)

    def segments(self, index: int) -> list[Segment]:
        return [Segment(int(self.docs[index]), 0, int(self.kept_tokens[index]))]

    def summary(self) -> dict[str, Any]:
        tokens = int(self.kept_tokens.sum())
        return {
            "mode": "long",
            "documents": len(self.docs),
            "skipped_documents": self.skipped_empty + self.skipped_late,
            "samples": len(self),
            "tokens": tokens,
            "padding_tokens": len(self) * self.seq_len - tokens,
            "truncated_records": int((self.truncated > 0).sum()),
            "truncated_tokens": int(self.truncated.sum()),
            "skipped_beyond_seq_len": self.skipped_late,
            "dropped_samples": 0,
            "dropped_tokens": 0,
        }


class _PackedLayout:
    """Usable documents, in a seeded order, as one token stream cut every `seq_len` tokens; the cuts
    (windows) without a loss-carrying token are dropped."""

    def __init__(self, stats: dict[str, np.ndarray], seq_len: int, seed: int, labels: Callable[[list[int]], list]):
        self.seq_len = seq_len
        self.skipped = int((stats["n_targets"] == 0).sum())
        # Shuffling documents before packing keeps sorted sources (by length, by origin) from
        # filling whole samples with look-alike neighbours.
        self.docs = np.random.default_rng(seed).permutation(np.flatnonzero(stats["n_targets"] > 0))
        self.ends = np.cumsum(stats["length"][self.docs])
        self.starts = self.ends - stats["length"][self.docs]
        self.stream = int(self.ends[-1]) if len(self.ends) else 0
        n_windows = -(-self.stream // seq_len)
        self.windows = np.flatnonzero(_labelled_windows(stats, self.docs, self.starts, seq_len, n_windows, labels))
        real = np.minimum(seq_len, self.stream - seq_len * np.arange(n_windows))  # the last window may be short
        self.tokens = int(real[self.windows].sum())
        self.dropped = n_windows - len(self.windows)

    def __len__(self) -> int:
        return len(self.windows)

    def segments(self, index: int) -> list[Segment]:
        window = int(self.windows[index])
        lo, hi = window * self.seq_len, min((window + 1) * self.seq_len, self.stream)
        first = int(np.searchsorted(self.ends, lo, side="right"))
        last = int(np.searchsorted(self.starts, hi, side="left"))
        segments = []
        for j in range(first, last):
            start = int(self.starts[j])
            stop = min(hi, int(self.ends[j]))
            segments.append(Segment(int(self.docs[j]), max(lo, start) - start, stop - start))
        return segments

    def summary(self) -> dict[str, Any]:
        return {
            "mode": "pack",
            "documents": len(self.docs),
            "skipped_documents": self.skipped,
            "samples": len(self),
            "tokens": self.tokens,
            "padding_tokens": len(self) * self.seq_len - self.tokens,
            "truncated_records": 0,
            "truncated_tokens": 0,
            "skipped_beyond_seq_len": 0,
            "dropped_samples": self.dropped,
            "dropped_tokens": self.stream - self.tokens,
        }


def _labelled_windows(
    stats: dict[str, np.ndarray], docs: np.ndarray, starts: np.ndarray, seq_len: int, n_windows: int,
    labels: Callable[[list[int]], list],
) -> np.ndarray:
    """Whether each `seq_len` window of the packed stream holds a loss-carrying token.

    From the statistics alone where they settle it: the windows of a document's first and last target have
    one, and so does every window between them when its targets are one contiguous run (text, prompt +
    completion, one-answer chats). Only a document with gaps between targets (multi-turn chat, masked
    pre-tokenized labels) that spans three windows or more has its labels read, in batches.
    """
    first, last, count = (stats[k][docs] for k in ("first_target", "last_target", "n_targets"))
    w_first, w_last = (starts + first) // seq_len, (starts + last) // seq_len
    contiguous = last - first + 1 == count
    edges = np.zeros(n_windows + 1, np.int64)
    np.add.at(edges, w_first[contiguous], 1)
    np.add.at(edges, w_last[contiguous] + 1, -1)
    labelled = np.cumsum(edges[:-1]) > 0
    labelled[w_first] = labelled[w_last] = True
    gappy = np.flatnonzero(~contiguous & (w_last - w_first >= 2))
    for lo in range(0, len(gappy), LABEL_READ_BATCH):
        batch = gappy[lo : lo + LABEL_READ_BATCH]
        for j, labels_T in zip(batch, labels([int(docs[j]) for j in batch])):
            labelled[(starts[j] + np.flatnonzero(labels_T != IGNORE)) // seq_len] = True
    return labelled


def build_dataset(
    source: str | list[str],
    tokenizer: Any,
    seq_len: int,
    *,
    pack: bool = False,
    seed: int = 0,
    max_records: int | None = None,
    split: str | None = None,
    subset: str | None = None,
    fields: dict[str, str] | None = None,
):
    """Read `source`, tokenize it (cached by `datasets`), and lay it out as `seq_len`-token samples.

    `seed` orders the documents before packing (unused in long mode); `max_records` keeps only the
    first records of the source; `split`, `subset` and `fields` pick the part of each source and map its columns
    (`lstune.data.sources.load_records`). Several sources (a list, each `SOURCE:WEIGHT` or all unweighted) give
    a `MixtureDataset` (lstune.data.mixture). Raises DataError for anything the user must fix.
    """
    from lstune.data.mixture import MixtureDataset
    from lstune.data.sources import mixture_entries

    entries = mixture_entries(source)
    read = dict(max_records=max_records, split=split, subset=subset, fields=fields,
                max_record_bytes=record_byte_limit(seq_len))
    if len(entries) == 1:
        return _build_one(entries[0][0], tokenizer, seq_len, pack=pack, seed=seed, **read)
    parts = [_build_one(name, tokenizer, seq_len, pack=pack, seed=seed, **read) for name, _ in entries]
    weights = [w for _, w in entries]
    return MixtureDataset(parts, [name for name, _ in entries], None if weights[0] is None else weights, seed)


def _build_one(source: str, tokenizer: Any, seq_len: int, *, pack: bool, seed: int, **read: Any) -> LongContextDataset:
    if seq_len < 2:
        raise ValueError(f"seq_len must be at least 2, got {seq_len}")
    records = load_records(source, **read)
    kind = detect_kind(records.dataset.column_names)
    check_one_kind(records.dataset, kind, source)
    check_tokenizer(kind, tokenizer)
    docs = _tokenize(records.dataset, kind.name, tokenizer)
    info = {"source": source, "origin": records.origin, "kind": kind.name, "fields": list(kind.fields),
            "records": len(records.dataset), "seq_len": seq_len, "field_map": dict(read.get("fields") or {})}
    return LongContextDataset(docs, seq_len, pack=pack, pad_id=_pad_id(tokenizer), seed=seed, info=info)


def describe(summary: dict[str, Any]) -> str:
    """One sentence on what happened to the data, e.g. for `lstune train` to print."""
    s = summary
    mapped = s.get("field_map") or {}
    fields = ", ".join(repr(f) + (f" from column {mapped[f]!r}" if mapped.get(f, f) != f else "") for f in s["fields"])
    text = (f"{s['records']} records (field{'s' if len(s['fields']) > 1 else ''} {fields}) -> {s['samples']} "
            f"samples of {s['seq_len']} tokens ({s['mode']} mode), {s['tokens']} tokens, "
            f"{_percent(s['padding_tokens'], s['samples'] * s['seq_len'])} padding")
    if s["truncated_records"]:
        dropped = _percent(s["truncated_tokens"], s["tokens"] + s["truncated_tokens"])
        text += f"; {s['truncated_records']} records truncated to {s['seq_len']} tokens, "
        text += f"{dropped} of tokens dropped"
    empty = s["skipped_documents"] - s["skipped_beyond_seq_len"]
    if empty:
        text += f"; {empty} records skipped (no trainable token)"
    if s["skipped_beyond_seq_len"]:
        late, seq_len = s["skipped_beyond_seq_len"], s["seq_len"]
        text += f"; {late} records skipped (no trainable token in the first {seq_len})"
    if s["dropped_samples"]:
        text += (f"; {s['dropped_samples']} packed samples dropped (no trainable token in them: the middle of a "
                 f"prompt or turn longer than {s['seq_len']} tokens, or a document's last token alone), "
                 f"{s['dropped_tokens']} tokens")
    return text


def _tokenize(records: Dataset, kind: str, tokenizer: Any) -> Dataset:
    """Tokenize every record with `datasets.map` (batched, written to an Arrow cache when the
    source has one, so the result is memory-mapped and reused by later runs)."""
    batch = max(1, min(MAP_MAX_BATCH, MAP_BATCH_BYTES * len(records) // max(1, records.data.nbytes)))
    return records.map(
        tokenize_batch,
        batched=True,
        with_indices=True,
        batch_size=batch,
        writer_batch_size=batch,
        remove_columns=records.column_names,
        features=document_features(),
        fn_kwargs={"kind": kind, "tokenizer": tokenizer},
        desc="Tokenizing",
        **_cache_kwargs(records, kind, tokenizer),
    )


def _cache_kwargs(records: Dataset, kind: str, tokenizer: Any) -> dict[str, str]:
    """Where `map` writes its result: lstune's folder in the datasets cache, never the user's data folder.

    By default `datasets` writes the cache beside the source's Arrow files, which for a
    `save_to_disk` folder means inside the user's (possibly read-only) data.
    """
    if not records.cache_files:
        return {}  # an in-memory source stays in memory
    from datasets import config
    from datasets.fingerprint import Hasher

    # `_fingerprint` (datasets has no public accessor) changes with the source files and any select().
    fingerprint = Hasher.hash([records._fingerprint, kind, tokenizer, tokenize_batch, CACHE_VERSION])
    path = config.HF_DATASETS_CACHE / "lstune-tokenized" / f"{fingerprint}.arrow"
    path.parent.mkdir(parents=True, exist_ok=True)
    return {"cache_file_name": str(path), "new_fingerprint": fingerprint}


def _pad_id(tokenizer: Any) -> int:
    """The pad id (its label is -100, so any in-vocabulary id works: fall back to eos, then 0)."""
    for name in ("pad_token_id", "eos_token_id"):
        value = getattr(tokenizer, name, None)
        if value is not None:
            return int(value)
    return 0


def _percent(part: int, whole: int) -> str:
    return f"{100 * part / whole:.0f}%" if whole else "0%"


def _no_usable_tokens_message(info: dict, seq_len: int) -> str:
    what = {"text": "every text is empty", "messages": "no conversation has an assistant turn",
            "input_ids": "every record is empty or has all labels -100",
            "prompt_completion": "every completion is empty", "alpaca": "no record has an output",
            "sharegpt": "no conversation has a gpt turn"}.get(info["kind"], "no record has a target")
    return (f"data source {info['source']}: {info['records']} records but no token to train on ({what}, or "
            f"no target within the first {seq_len} tokens). Check the data, or use a longer sequence "
            "length or packing.")
