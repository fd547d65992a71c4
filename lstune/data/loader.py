"""An infinite, deterministic, resumable stream of batches.

The stream is a flat sequence of sample indices: epoch e is a permutation of the dataset drawn
from (seed, e), epochs following one another forever. Its position is one integer, the number
of samples consumed, which is all a checkpoint needs to record: `start_sample=N` computes the
epoch and offset of sample N and starts there, without loading the N samples before it. With
data parallelism every rank reads its own interleaved share of the same stream (rank r takes
stream samples r, r + dp_size, ...), so `start_sample` stays the global count of samples
consumed by all ranks together.

Written on torch's DataLoader with a custom sampler rather than `DistributedSampler` because
the latter is finite per epoch and can only resume at an epoch boundary.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler


class StreamSampler(Sampler[int]):
    """Sample indices of the infinite stream, from global position `start` on, one rank's share."""

    def __init__(
        self,
        num_samples: int,
        *,
        seed: int,
        shuffle: bool = True,
        start: int = 0,
        rank: int = 0,
        world_size: int = 1,
    ):
        if num_samples < 1:
            raise ValueError("the stream needs at least one sample")
        if start < 0 or seed < 0 or not 0 <= rank < world_size:
            raise ValueError(f"invalid stream position: start={start}, seed={seed}, rank={rank}/{world_size}")
        self.num_samples, self.seed, self.shuffle = num_samples, seed, shuffle
        self.start, self.rank, self.world_size = start, rank, world_size

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The sample order of `epoch` (the identity when not shuffling)."""
        if not self.shuffle:
            return np.arange(self.num_samples)
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)

    def __iter__(self) -> Iterator[int]:
        position = self.start + self.rank
        epoch, order = -1, None
        while True:
            e, offset = divmod(position, self.num_samples)
            if e != epoch:
                epoch, order = e, self.epoch_order(e)
            yield int(order[offset])
            position += self.world_size


def collate(samples: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Stack samples into the batch contract: a dict of [B, S] LongTensors."""
    return {key: torch.stack([s[key] for s in samples]) for key in samples[0]}


def make_dataloader(
    ds: Dataset,
    micro_batch_size: int,
    *,
    seed: int,
    shuffle: bool = True,
    start_sample: int = 0,
    num_workers: int = 0,
    dp_rank: int = 0,
    dp_size: int = 1,
) -> DataLoader:
    """Infinite batches of `micro_batch_size` samples from stream position `start_sample`.

    Same seed and start -> identical batches, whatever `num_workers`. The training loop advances
    its count by `micro_batch_size * dp_size` per micro-batch and passes it back on resume.
    """
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
    sampler = StreamSampler(
        len(ds), seed=seed, shuffle=shuffle, start=start_sample, rank=dp_rank, world_size=dp_size
    )
    return DataLoader(
        ds,
        batch_size=micro_batch_size,
        sampler=sampler,
        collate_fn=collate,
        num_workers=num_workers,
        persistent_workers=num_workers > 0,
    )
