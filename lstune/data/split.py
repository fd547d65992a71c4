"""Holding out validation samples from the training dataset (`--eval-split`).

The split is over samples, drawn once from the seed, so every rank and every resume sees the same two
sets. Long mode takes a seeded random choice of samples (one document each), so a source sorted by
length or origin still gives a representative validation set. Pack mode takes the last samples of the
packed stream, whose documents are already in a seeded random order: the held-out samples are then one
contiguous run, so at most one document is cut between training and validation.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from lstune.errors import DataError


class SampleView:
    """Samples `indices` of a dataset, with the dataset's `summary()` recounted for them."""

    def __init__(self, base: Any, indices: np.ndarray, role: str):
        self.base = base
        self.indices = indices
        self.role = role

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, index: int):
        return self.base[int(self.indices[index])]

    def summary(self) -> dict[str, Any]:
        """The whole data's counts (records, samples, tokens before the split) and this part's `split_samples`."""
        summary = self.base.summary()
        summary["split_samples"] = len(self)
        summary["note"] = f"{summary['note']}; {len(self)} of the {summary['samples']} samples used for {self.role}"
        return summary


def split_samples(dataset: Any, fraction: float, *, pack: bool, seed: int) -> tuple[SampleView, SampleView]:
    """(training view, validation view) of `dataset`, with ceil(fraction × samples) held out for validation."""
    n = len(dataset)
    n_eval = math.ceil(fraction * n)
    if n_eval >= n:
        raise DataError(
            f"--eval-split {fraction} of {n} samples would leave nothing to train on; use a smaller fraction, more "
            "data, or --eval-data."
        )
    if pack:
        order = np.arange(n)
    else:
        order = np.random.default_rng([seed, 0xE7A1]).permutation(n)
    train, held = np.sort(order[: n - n_eval]), np.sort(order[n - n_eval :])
    return SampleView(dataset, train, "training"), SampleView(dataset, held, "validation")
