"""Samples built from hand-made documents: exact tensors in both modes, accounting, errors."""

from __future__ import annotations

import pytest
import torch

from lstune.data.dataset import build_dataset
from lstune.errors import DataError
from tests.unit.data._helpers import write_jsonl

X = -100
A, B, C = [10, 11, 12], [20, 21, 22, 23, 24], [30, 31]


def _build(tmp_path, records, tokenizer, seq_len, **kw):
    return build_dataset(str(write_jsonl(tmp_path / "d.jsonl", records)), tokenizer, seq_len, **kw)


def _rows(ds) -> list[tuple[list[int], list[int], list[int]]]:
    return [(s["input_ids"].tolist(), s["position_ids"].tolist(), s["shift_labels"].tolist()) for s in ds]


def test_long_mode_pads_and_truncates_keeping_the_real_target_at_the_cut(tmp_path, byte_tok):
    ds = _build(tmp_path, [{"input_ids": A}, {"input_ids": list(range(20, 28))}], byte_tok, 6)
    assert _rows(ds) == [
        ([10, 11, 12, 0, 0, 0], [0, 1, 2, 3, 4, 5], [11, 12, X, X, X, X]),
        ([20, 21, 22, 23, 24, 25], [0, 1, 2, 3, 4, 5], [21, 22, 23, 24, 25, 26]),
    ]
    s = ds.summary()
    assert (s["mode"], s["records"], s["samples"], s["tokens"], s["padding_tokens"]) == ("long", 2, 2, 9, 3)
    assert (s["truncated_records"], s["truncated_tokens"]) == (1, 2)
    assert "1 records truncated to 6 tokens, 18% of tokens dropped" in s["note"]


def test_samples_are_long_tensors_of_seq_len(tmp_path, byte_tok):
    sample = _build(tmp_path, [{"text": "hello"}], byte_tok, 16)[0]
    assert {k: (v.dtype, tuple(v.shape)) for k, v in sample.items()} == {
        k: (torch.int64, (16,)) for k in ("input_ids", "position_ids", "shift_labels")
    }


def test_pack_mode_restarts_positions_continues_split_documents_and_pads_the_tail(tmp_path, byte_tok):
    # seed 1 keeps these three documents in their given order (numpy default_rng permutation).
    ds = _build(tmp_path, [{"input_ids": d} for d in (A, B, C)], byte_tok, 4, pack=True, seed=1)
    assert _rows(ds) == [
        ([10, 11, 12, 20], [0, 1, 2, 0], [11, 12, X, 21]),  # A's last token never predicts B's first
        ([21, 22, 23, 24], [0, 1, 2, 3], [22, 23, 24, X]),  # B goes on as a new segment from 0
        ([30, 31, 0, 0], [0, 1, 0, 1], [31, X, X, X]),  # the pad run is a segment of its own
    ]
    s = ds.summary()
    counts = (s["mode"], s["samples"], s["tokens"], s["padding_tokens"], s["truncated_tokens"])
    assert counts == ("pack", 3, 10, 2, 0)


def test_pack_seed_orders_documents(tmp_path, byte_tok):
    # seed 3 reverses three documents.
    ds = _build(tmp_path, [{"input_ids": d} for d in (A, B, C)], byte_tok, 4, pack=True, seed=3)
    assert [r[0] for r in _rows(ds)] == [[30, 31, 20, 21], [22, 23, 24, 10], [11, 12, 0, 0]]


def test_a_document_longer_than_several_samples_is_split_across_them(tmp_path, byte_tok):
    ds = _build(tmp_path, [{"input_ids": list(range(10, 21))}], byte_tok, 4, pack=True)
    assert _rows(ds) == [
        ([10, 11, 12, 13], [0, 1, 2, 3], [11, 12, 13, 14]),
        ([14, 15, 16, 17], [0, 1, 2, 3], [15, 16, 17, 18]),
        ([18, 19, 20, 0], [0, 1, 2, 0], [19, 20, X, X]),
    ]


def test_packing_keeps_every_token_and_target_exactly_once(tmp_path, byte_tok):
    texts = [{"text": "x" * n} for n in (1, 7, 30, 3, 64, 2, 15)]
    long = _build(tmp_path, texts, byte_tok, 80)
    packed = build_dataset(str(tmp_path / "d.jsonl"), byte_tok, 16, pack=True, seed=5)
    real = lambda ds: sum(int((s["input_ids"] != 0).sum()) for s in ds)  # noqa: E731
    targets = lambda ds: sum(int((s["shift_labels"] != X).sum()) for s in ds)  # noqa: E731
    with_bos_eos = sum(n + 2 for n in (1, 7, 30, 3, 64, 2, 15))
    assert real(packed) == real(long) == packed.summary()["tokens"] == with_bos_eos
    # Each document loses only the target after its last token; a cut inside a document loses none.
    assert targets(packed) == targets(long) == packed.summary()["tokens"] - 7


def test_chat_samples_train_only_on_assistant_turns(tmp_path, byte_tok):
    chat = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]
    sample = _build(tmp_path, [{"messages": chat}], byte_tok, 64)[0]
    targets = sample["shift_labels"][sample["shift_labels"] != X].tolist()
    assert byte_tok.decode(targets) == "4</s>"
    assert _build(tmp_path, [{"messages": chat}], byte_tok, 64).summary()["fields"] == ["messages"]


def test_text_with_a_real_hf_tokenizer(tmp_path, word_tok):
    ds = _build(tmp_path, [{"text": "hello world"}, {"text": "how are"}], word_tok, 8, pack=True, seed=1)
    (ids, positions, labels), = _rows(ds)
    tokens = word_tok.convert_ids_to_tokens
    assert tokens(ids) == ["<s>", "hello", "world", "</s>", "<s>", "how", "are", "</s>"]
    assert positions == [0, 1, 2, 3, 0, 1, 2, 3]
    assert tokens([t for t in labels if t != X]) == ["hello", "world", "</s>", "how", "are", "</s>"]


def test_records_without_targets_are_skipped_and_counted(tmp_path, byte_tok):
    ds = _build(tmp_path, [{"text": "ok"}, {"text": ""}, {"text": "fine"}], byte_tok, 8)
    s = ds.summary()
    assert (s["records"], s["documents"], s["skipped_documents"], len(ds)) == (3, 2, 1, 2)
    assert "1 records skipped (no trainable token)" in s["note"]
    assert s["max_token_id"] == max(byte_tok.encode("okfine"))


def test_chat_whose_answer_lies_beyond_seq_len_is_skipped_in_long_mode(tmp_path, byte_tok):
    late = [{"role": "user", "content": "q" * 50}, {"role": "assistant", "content": "a"}]
    early = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    s = _build(tmp_path, [{"messages": late}, {"messages": early}], byte_tok, 32).summary()
    assert (s["samples"], s["skipped_beyond_seq_len"]) == (1, 1)
    assert "1 records skipped (no trainable token in the first 32)" in s["note"]


@pytest.mark.parametrize(
    ("records", "message"),
    [
        ([{"text": ""}, {"text": ""}], "2 records but no token to train on \\(every text is empty"),
        ([{"messages": [{"role": "user", "content": "hi"}]}], "no conversation has an assistant turn"),
        ([{"input_ids": [5, 6], "labels": [X, X]}], "all labels -100"),
    ],
)
def test_zero_usable_tokens(tmp_path, byte_tok, records, message):
    with pytest.raises(DataError, match=message):
        _build(tmp_path, records, byte_tok, 8)


def test_max_records_and_cache_reuse(tmp_path, byte_tok):
    import datasets

    _build(tmp_path, [{"text": str(i)} for i in range(5)], byte_tok, 8, max_records=2)
    cache = datasets.config.HF_DATASETS_CACHE / "lstune-tokenized"
    files = sorted(cache.iterdir())
    ds = build_dataset(str(tmp_path / "d.jsonl"), byte_tok, 8, max_records=2)
    assert (len(ds), ds.summary()["records"]) == (2, 2)
    assert sorted(cache.iterdir()) == files  # the second build read the tokenized cache


def test_pack_drops_samples_without_a_target_and_counts_them(tmp_path, byte_tok):
    # bos + 60-byte prompt + 2 completion bytes + eos = 64 tokens: at seq_len 16 three cuts of each hold no target.
    records = [{"prompt": "p" * 60, "completion": "ab"}, {"prompt": "q" * 60, "completion": "cd"}]
    ds = _build(tmp_path, records, byte_tok, 16, pack=True, seed=0)
    assert all(int((s["shift_labels"] != X).sum()) > 0 for s in ds)
    s = ds.summary()
    assert (s["samples"], s["dropped_samples"], s["dropped_tokens"]) == (2, 6, 96)
    assert s["tokens"] + s["dropped_tokens"] == 2 * (61 + 3)
    assert "6 packed samples dropped (no trainable token in them" in s["note"]


def test_pack_drops_a_last_sample_holding_only_a_documents_final_token(tmp_path, byte_tok):
    # 64 + 65 tokens at seq_len 64: the third cut is b's eos alone, whose target is -100.
    ds = _build(tmp_path, [{"text": "a" * 62}, {"text": "b" * 63}], byte_tok, 64, pack=True, seed=0)
    assert [int((s["shift_labels"] != X).sum()) for s in ds] == [63, 64]
    assert (ds.summary()["dropped_samples"], ds.summary()["dropped_tokens"]) == (1, 1)


def _packed_reference(docs, order, seq_len):
    """Every seq_len cut of the documents laid end to end in `order`, keeping those with a target (by brute force)."""
    ids, labels, positions = [], [], []
    for d in order:
        doc_ids, doc_labels = docs[d]
        shifted = doc_labels[1:] + [X]
        ids += doc_ids
        labels += shifted
        positions += [(d, t) for t in range(len(doc_ids))]
    out = []
    for lo in range(0, len(ids), seq_len):
        if all(label == X for label in labels[lo : lo + seq_len]):
            continue
        pad = seq_len - len(ids[lo : lo + seq_len])
        pos, run = [], 0
        for k, (d, _) in enumerate(positions[lo : lo + seq_len]):
            run = run + 1 if k and positions[lo + k - 1][0] == d else 0
            pos.append(run)
        out.append((ids[lo : lo + seq_len] + [0] * pad, pos + list(range(pad)), labels[lo : lo + seq_len] + [X] * pad))
    return out


def test_pack_keeps_exactly_the_cuts_with_a_target_for_gappy_labels(tmp_path, byte_tok):
    import numpy as np

    rng = np.random.default_rng(7)
    docs = []
    for _ in range(30):
        n = int(rng.integers(2, 60))
        ids = rng.integers(3, 250, n).tolist()
        # Runs of targets separated by long ignored stretches (multi-turn chat), some documents with none: several
        # documents span cuts between their first and last target, with and without a target of their own.
        mask = np.zeros(n, bool)
        for start in rng.integers(0, n, int(rng.integers(0, 4))):
            mask[start : start + int(rng.integers(1, 4))] = True
        docs.append((ids, [t if m else X for t, m in zip(ids, mask)]))
    records = [{"input_ids": ids, "labels": labels} for ids, labels in docs]
    ds = _build(tmp_path, records, byte_tok, 8, pack=True, seed=4)
    usable = [i for i, (_, labels) in enumerate(docs) if any(label != X for label in labels[1:])]
    order = np.random.default_rng(4).permutation(np.array(usable)).tolist()
    assert _rows(ds) == _packed_reference(docs, order, 8)
