"""A mixture of several `--data` sources, each `SOURCE:WEIGHT`, as one map-style dataset.

Each source is built as its own `LongContextDataset` (tokenized, laid out and, with --pack, packed on its
own: no sample mixes two sources). The mixture is a fixed list of slots, one "mixture epoch": source i
gets ceil(w_i · N) slots with N = max_i ceil(n_i / w_i) (n_i its samples, w_i its normalised weight), so
every sample of every source appears at least once per mixture epoch and the lighter sources repeat
(`datasets.interleave_datasets`' "all_exhausted" rule). Slot k of source i is sample perm_c[k mod n_i]
of that source, perm_c a seeded permutation per cycle c = k // n_i, so the repeats are spread out.

Without weights the sources are concatenated (each counts by its size). Either way the result is a plain
map-style dataset: the loader's seeded, resumable stream (lstune.data.loader) shuffles its slots exactly as
it shuffles one source's samples, so determinism and resume carry over unchanged. `realised_shares` counts
which sources the first `consumed` samples of that stream came from.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch



def slot_counts(sizes: list[int], weights: list[float] | None) -> list[int]:
    """How many slots each source gets in one mixture epoch (see the module docstring)."""
    if weights is None:
        return list(sizes)
    total = sum(weights)
    shares = [w / total for w in weights]
    epoch = max(math.ceil(n / s) for n, s in zip(sizes, shares))
    return [max(n, math.ceil(s * epoch)) for n, s in zip(sizes, shares)]


class MixtureDataset(torch.utils.data.Dataset):
    """Several `LongContextDataset`s as one; `ds[i]` is a sample of one of them (see the module docstring)."""

    def __init__(self, parts: list, names: list[str], weights: list[float] | None, seed: int):
        self.parts, self.names, self.weights, self.seed = parts, names, weights, seed
        counts = slot_counts([len(p) for p in parts], weights)
        self.source_of = np.repeat(np.arange(len(parts)), counts)
        self.local_index = np.concatenate([
            _cycled_permutation(len(part), count, seed, i) for i, (part, count) in enumerate(zip(parts, counts))
        ])
        self.counts = counts
        self._summary = self._build_summary()

    def __len__(self) -> int:
        return len(self.source_of)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not -len(self) <= index < len(self):
            raise IndexError(f"sample {index} out of range for {len(self)} samples")
        index %= len(self)
        return self.parts[int(self.source_of[index])][int(self.local_index[index])]

    def summary(self) -> dict[str, Any]:
        return dict(self._summary)

    def _build_summary(self) -> dict[str, Any]:
        parts = [p.summary() for p in self.parts]
        total = len(self)
        shares = []
        sizes = [len(p) for p in self.parts]  # a part may be a split's view (lstune.data.split): its own samples
        for name, count, weight, size in zip(self.names, self.counts, self.weights or [None] * len(self.parts), sizes):
            asked = f", weight {weight:g}" if weight is not None else ""
            shares.append(f"{name} {100 * count / total:.1f}% ({count} slots for its {size} samples{asked})")
        note = (f"mixture of {len(parts)} sources, {total} samples per mixture epoch: " + "; ".join(shares) + ". "
                + " | ".join(f"{name}: {part['note']}" for name, part in zip(self.names, parts)))
        return {
            "mode": parts[0]["mode"],
            "seq_len": parts[0]["seq_len"],
            "samples": total,
            "sources": [{"source": name, "slots": count, "share": count / total, "weight": weight, **part}
                        for name, count, weight, part in
                        zip(self.names, self.counts, self.weights or [None] * len(parts), parts)],
            "max_token_id": max(part["max_token_id"] for part in parts),
            "note": note,
            # the sources' own counts, added up (the data preview and the truncation warning read them)
            **{key: sum(part.get(key) or 0 for part in parts) for key in _COUNTS},
        }


_COUNTS = ("records", "tokens", "padding_tokens", "truncated_records", "truncated_tokens", "skipped_documents",
           "dropped_samples", "dropped_tokens")


def _cycled_permutation(size: int, count: int, seed: int, source: int) -> np.ndarray:
    cycles = -(-count // size)
    if cycles == 1 and count == size:
        return np.arange(size)  # a source seen once per epoch keeps its order: the loader shuffles anyway
    orders = [np.random.default_rng([seed, source, c]).permutation(size) for c in range(cycles)]
    return np.concatenate(orders)[:count]


def realised_shares(dataset: MixtureDataset, sampler, consumed: int) -> dict[str, float]:
    """The share of each source among the first `consumed` samples of the stream `sampler` draws (a
    `StreamSampler` over `dataset` from position 0, one rank): what the run actually trained on."""
    counts = np.zeros(len(dataset.parts), dtype=np.int64)
    stream = iter(sampler)
    for _ in range(consumed):
        counts[dataset.source_of[next(stream)]] += 1
    return {name: (int(c) / consumed if consumed else 0.0) for name, c in zip(dataset.names, counts)}
