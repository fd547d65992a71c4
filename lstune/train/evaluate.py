"""Validation: the exact mean token loss of the validation samples, under any parallel layout.

The loss is the same quantity as the training loss — Σ loss sums / Σ loss-carrying tokens over every
sample — all-reduced over the world like `lstune.parallel.loss.global_mean`, so SP = 2 gives the
number SP = 1 gives, and ZeRO changes nothing. It runs the prepared model's own loss head (tiled logits
and loss, tiled MLP) with autograd off: checkpointing then runs the plain layer forward and nothing is
offloaded or saved for backward.

Every rank processes the same number of samples (ZeRO-3 gathers weights inside each forward, and a
rank that stopped early would hang the others): rank r takes samples r, r + world, …, and a rank
whose share runs out first takes a blank sample (every label ignored), which adds zero to both sums.

Passkey accuracy (`passkey=True`, for answer-only passkey records: each sample's labels are its answer): a
sample is right when the argmax of every labelled position is its label (teacher-forced greedy decoding;
the LM head runs on the labelled rows only). Under SP the answer may sit on any rank's shard (contiguous, or
FPDT's pieces with chunked attention: both sums are over tokens, so the layout does not matter), so each
rank counts its misses per global sample index and one sum over the world adds them up per sample before
any sample is judged, exact as the loss is.
"""

from __future__ import annotations

import math
import time
from typing import Any, Iterator

from lstune.data.batch import IGNORE_INDEX


class Evaluator:
    """Evaluates `dataset` (at most `max_samples` of it, in order) with `sums(batch, model, misses=...)`, which
    returns (loss sum, label count, argmax misses or None) like `PreparedModel.eval_sums`. `chunks`: the model's
    chunked attention (`MemoryPlan.attn_chunking`), which lays SP shards out as it expects."""

    def __init__(self, dataset: Any, sums, runtime, *, max_samples: int | None = None, passkey: bool = False,
                 chunks: Any = None):
        self.dataset = dataset
        self.chunks = chunks
        self.sums = sums
        self.runtime = runtime
        self.passkey = passkey
        self.samples = min(len(dataset), max_samples) if max_samples else len(dataset)

    def run(self, model) -> dict[str, Any]:
        """`eval_loss`, `eval_ppl`, `eval_tokens`, `eval_samples`, `eval_time_s` and with `passkey`
        `eval_passkey_acc`; restores train mode."""
        import torch

        from lstune.parallel.sp_data import SPDataAdapter

        start = time.perf_counter()
        was_training = model.training
        model.eval()
        loss_total, count, answers = 0.0, 0, []
        try:
            with torch.no_grad():
                batches = self._batches()
                if self.runtime.sp > 1:
                    batches = SPDataAdapter(batches, self.runtime.dims, device=self.runtime.device, chunks=self.chunks)
                for batch in batches:
                    batch = {k: v.to(self.runtime.device) for k, v in batch.items()}
                    with self._autocast():
                        loss_sum, n, misses = self.sums(batch, model, misses=self.passkey)
                    loss_total += float(loss_sum)
                    count += int(n)
                    answers.append((int(n), int(misses) if misses is not None else 0))
        finally:
            model.train(was_training)
        loss_total, count = self.runtime.sum([loss_total, float(count)])
        loss = loss_total / count if count else float("nan")
        accuracy = {"eval_passkey_acc": self._accuracy(answers)} if self.passkey else {}
        return {
            "eval_loss": loss,
            "eval_ppl": math.exp(loss) if loss < 700 else float("inf"),
            "eval_tokens": int(count),
            "eval_samples": self.samples,
            **accuracy,
            "eval_time_s": time.perf_counter() - start,
        }

    def _accuracy(self, answers: list[tuple[int, int]]) -> float:
        """The share of answered samples with no miss: (labels, misses) of each batch this rank ran, summed per
        global sample over the world (an SP group's shards of one sample meet at its index)."""
        order = self._sample_order()
        width = self.runtime.world_size * math.ceil(self.samples / self.runtime.world_size)
        totals = [0.0] * (2 * width)
        for index, (labels, misses) in zip(order, answers):
            totals[index] += labels
            totals[width + index] += misses
        totals = self.runtime.sum(totals)
        answered = [i for i in range(width) if totals[i] > 0]
        right = sum(1 for i in answered if totals[width + i] == 0)
        return right / len(answered) if answered else float("nan")

    def _sample_order(self) -> list[int]:
        """The global index of each sample this rank runs, in order: its own share (see `_batches`), or under SP
        its group's shares interleaved as `SPDataAdapter` yields them."""
        world, rounds = self.runtime.world_size, math.ceil(self.samples / self.runtime.world_size)
        if self.runtime.sp == 1:
            return [i * world + self.runtime.rank for i in range(rounds)]
        group = self.runtime.dims.sp_group_ranks(self.runtime.dims.dp_rank)
        return [i * world + rank for i in range(rounds) for rank in group]

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
    out["shift_labels"] = torch.full_like(sample["shift_labels"], IGNORE_INDEX)
    return out


def eval_due(step: int, max_steps: int, every: int | None) -> bool:
    """Evaluate every `every` steps and always after the last step."""
    return step == max_steps or (every is not None and step % every == 0)
