"""Holding out validation samples from the training dataset (`--eval-split`).

The split is over samples, drawn once from the seed, so every rank and every resume sees the same two
sets. Long mode takes a seeded random choice of samples (one document each), so a source sorted by
length or origin still gives a representative validation set. Pack mode takes the last samples of the
packed stream, whose documents are already in a seeded random order: the held-out samples are then one
contiguous run, so at most one document is cut between training and validation.

A mixture of sources (lstune.data.mixture) is split source by source, before its weights repeat any
sample: each source holds out ceil(fraction × its samples) by the rule above, the training mixture is
rebuilt from what each source keeps (same weights, same seed), and no held-out sample is ever a training
sample. Splitting the mixture's slots instead would hold out copies of samples that other slots repeat.
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


class InterleavedSamples:
    """The validation samples of a mixture's sources, each once, interleaved evenly: any first k of them (the
    evaluator takes the first --eval-max-samples) hold the sources in the proportions of the whole set."""

    def __init__(self, parts: list[SampleView], names: list[str], base_summary: dict[str, Any]):
        self.parts, self.names, self._base = parts, names, base_summary
        sizes = [len(p) for p in parts]
        spread = np.concatenate([(np.arange(n) + 0.5) / n for n in sizes])  # each source's samples over [0, 1)
        order = np.argsort(spread, kind="stable")
        self.source_of = np.repeat(np.arange(len(parts)), sizes)[order]
        self.local_index = np.concatenate([np.arange(n) for n in sizes])[order]

    def __len__(self) -> int:
        return len(self.source_of)

    def __getitem__(self, index: int):
        return self.parts[int(self.source_of[index])][int(self.local_index[index])]

    def summary(self) -> dict[str, Any]:
        """The mixture's counts before the split, and the held-out samples per source."""
        held = ", ".join(f"{len(p)} from {name}" for p, name in zip(self.parts, self.names))
        return {**self._base, "split_samples": len(self),
                "note": f"{self._base['note']}; {len(self)} samples used for validation, each once ({held})"}


def split_samples(dataset: Any, fraction: float, *, pack: bool, seed: int) -> tuple[Any, Any]:
    """(training, validation) of `dataset`, with ceil(fraction × samples) held out for validation (per source for
    a mixture: see the module docstring)."""
    from lstune.data.mixture import MixtureDataset

    if isinstance(dataset, MixtureDataset):
        return _split_mixture(dataset, fraction, pack=pack, seed=seed)
    train, held = _held_out(len(dataset), fraction, pack=pack, rng_key=[seed, 0xE7A1])
    return SampleView(dataset, train, "training"), SampleView(dataset, held, "validation")


def _split_mixture(mixture: Any, fraction: float, *, pack: bool, seed: int) -> tuple[Any, InterleavedSamples]:
    from lstune.data.mixture import MixtureDataset

    trains, helds = [], []
    for i, (part, name) in enumerate(zip(mixture.parts, mixture.names)):
        train, held = _held_out(len(part), fraction, pack=pack, rng_key=[seed, 0xE7A1, i], source=name)
        trains.append(SampleView(part, train, "training"))
        helds.append(SampleView(part, held, "validation"))
    training = MixtureDataset(trains, mixture.names, mixture.weights, mixture.seed)
    return training, InterleavedSamples(helds, mixture.names, mixture.summary())


def _held_out(n: int, fraction: float, *, pack: bool, rng_key: list[int], source: str | None = None):
    """(kept, held out) sample indices, each sorted."""
    n_eval = math.ceil(fraction * n)
    if n_eval >= n:
        of = f"the {n} samples of --data {source}" if source else f"{n} samples"
        raise DataError(
            f"--eval-split {fraction} of {of} would leave nothing to train on; use a smaller fraction, more "
            "data, or --eval-data."
        )
    order = np.arange(n) if pack else np.random.default_rng(rng_key).permutation(n)
    return np.sort(order[: n - n_eval]), np.sort(order[n - n_eval :])
