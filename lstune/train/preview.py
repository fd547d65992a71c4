"""What a run will train on, before any weights load: `lstune data --preview`.

Builds the tokenizer and the samples exactly as `train` does (same code: lstune.train.run's data setup)
and returns the counts and the first sample, each token marked with whether it carries a loss. Token j
is trained when the label at j - 1 (which predicts j) is not ignored: labels come pre-shifted.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lstune.data.batch import IGNORE_INDEX


@dataclass
class DataPreview:
    summary: dict[str, Any]
    # (decoded text, carries a loss), in order; (" … N tokens … ", None) where tokens are skipped
    runs: list[tuple[str, bool | None]] = field(default_factory=list)
    sample_tokens: int = 0
    sample_trained: int = 0
    shown_tokens: int = 0
    eval_summary: dict[str, Any] | None = None


def preview_data(config, max_tokens: int = 400) -> DataPreview:
    """Counts of samples / tokens / truncated / dropped, and the first sample's first `max_tokens` tokens
    decoded in runs of trained and not-trained tokens."""
    from lstune.models.loading import resolve_model
    from lstune.train.run import _setup_data, _setup_eval_data, _setup_tokenizer

    spec = resolve_model(config.model.name, trust_remote_code=config.model.trust_remote_code)
    from lstune.data.templates import set_chat_template

    tokenizer, _ = _setup_tokenizer(config, spec)
    set_chat_template(tokenizer, config.data.chat_template)  # as train does: the mask shown is the one trained
    dataset = _setup_data(config, tokenizer, spec.config)
    train, held = _setup_eval_data(config, tokenizer, spec.config, dataset)
    sample = next(train.samples()) if hasattr(train, "samples") else train[0]  # a stream: its first sample
    ids, labels = sample["input_ids"].tolist(), sample["shift_labels"].tolist()
    trained = [False] + [label != IGNORE_INDEX for label in labels[:-1]]
    real = len(ids) - _trailing_padding(labels, sample["position_ids"].tolist(), train.summary()["mode"])
    windows = _windows(trained[:real], max_tokens)
    preview = DataPreview(
        summary=train.summary(), sample_tokens=real, sample_trained=sum(trained[:real]),
        shown_tokens=sum(end - start for start, end in windows), eval_summary=held.summary() if held is not None else None,
    )
    shown_until = 0
    for begin, end in windows:
        if begin > shown_until:
            preview.runs.append((f" … {begin - shown_until:,} tokens … ", None))
        start = begin
        for j in range(begin + 1, end + 1):
            if j == end or trained[j] != trained[start]:
                preview.runs.append((tokenizer.decode(ids[start:j]), trained[start]))
                start = j
        shown_until = end
    return preview


def _windows(trained: list[bool], max_tokens: int) -> list[tuple[int, int]]:
    """The token ranges to show: the first `max_tokens`, or, when the first trained token lies past them (a long
    prompt before its completion), the first half of that and the stretch leading into the trained tokens."""
    n = len(trained)
    first = trained.index(True) if True in trained else n
    if n <= max_tokens or first < max_tokens:
        return [(0, min(n, max_tokens))] if max_tokens else []
    head = max_tokens // 2
    tail_start = max(head, first - max_tokens // 4)
    return [(0, head), (tail_start, min(n, tail_start + max_tokens - head))]


def _trailing_padding(labels: list[int], positions: list[int], mode: str) -> int:
    """Tokens of padding at the end of a long-mode sample (ignored labels after the document's last token)."""
    if mode != "long":
        return 0
    n = 0
    for label in reversed(labels):
        if label != IGNORE_INDEX:
            break
        n += 1
    return max(0, n - 1)  # the document's own last token has an ignored label too
