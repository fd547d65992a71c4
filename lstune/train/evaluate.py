"""Validation: the exact mean token loss of the validation samples, under any parallel layout.

The loss is the same quantity as the training loss — Σ loss sums / Σ loss-carrying tokens over every
sample — all-reduced over the world like `lstune.parallel.loss.global_mean`, so SP = 2 gives the
number SP = 1 gives, and ZeRO changes nothing. It runs the prepared model's own loss head (tiled logits
and loss, tiled MLP) with autograd off: checkpointing then runs the plain layer forward and nothing is
offloaded or saved for backward.

Every rank processes the same number of samples (ZeRO-3 gathers weights inside each forward, and a
rank that stopped early would hang the others): rank r takes samples r, r + world, …, and a rank
whose share runs out first takes a blank sample (every label ignored), which adds zero to both sums.
"""

from __future__ import annotations

import math
import time
from typing import Any, Iterator

IGNORE = -100


class Evaluator:
    """Evaluates `dataset` (at most `max_samples` of it, in order) with `loss_sum(batch, model)`."""

    def __init__(self, dataset: Any, loss_sum, runtime, *, max_samples: int | None = None):
        self.dataset = dataset
        self.loss_sum = loss_sum
        self.runtime = runtime
        self.samples = min(len(dataset), max_samples) if max_samples else len(dataset)

    def run(self, model) -> dict[str, Any]:
        """`eval_loss`, `eval_ppl`, `eval_tokens`, `eval_samples` and `eval_time_s`; restores train mode."""
        import torch

        from lstune.parallel.sp_data import SPDataAdapter

        start = time.perf_counter()
        was_training = model.training
        model.eval()
        loss_total, count = 0.0, 0
        try:
            with torch.no_grad():
                batches = self._batches()
                if self.runtime.sp > 1:
                    batches = SPDataAdapter(batches, self.runtime.dims, device=self.runtime.device)
                for batch in batches:
                    batch = {k: v.to(self.runtime.device) for k, v in batch.items()}
                    with self._autocast():
                        loss_sum, n = self.loss_sum(batch, model)
                    loss_total += float(loss_sum)
                    count += int(n)
        finally:
            model.train(was_training)
        loss_total, count = self.runtime.sum([loss_total, float(count)])
        loss = loss_total / count if count else float("nan")
        return {
            "eval_loss": loss,
            "eval_ppl": math.exp(loss) if loss < 700 else float("inf"),
            "eval_tokens": int(count),
            "eval_samples": self.samples,
            "eval_time_s": time.perf_counter() - start,
        }

    def _batches(self) -> Iterator[dict]:
        """This rank's share, one sample per batch, padded with blank samples to the longest share."""
        world, rank = self.runtime.world_size, self.runtime.rank
        for i in range(math.ceil(self.samples / world)):
            index = i * world + rank
            sample = self.dataset[index] if index < self.samples else _blank(self.dataset[0])
            yield {k: v.unsqueeze(0) for k, v in sample.items()}

    def _autocast(self):
        import torch

        dtype = self.runtime.autocast_dtype
        return torch.autocast(self.runtime.device.type, dtype=dtype or torch.float32, enabled=dtype is not None)


def _blank(sample: dict) -> dict:
    """`sample` with every label ignored: it runs through the model (keeping collectives in step) but counts nothing."""
    import torch

    out = dict(sample)
    out["shift_labels"] = torch.full_like(sample["shift_labels"], IGNORE)
    return out


def eval_due(step: int, max_steps: int, every: int | None) -> bool:
    """Evaluate every `every` steps and always after the last step."""
    return step == max_steps or (every is not None and step % every == 0)
