"""The exact global mean loss under sequence parallelism, data parallelism and gradient accumulation.

The unsharded objective of one optimizer step is the mean token loss over every loss-carrying token of
the global batch (all DP ranks, all micro-batches of the accumulation window):

    L = (Σ_ranks Σ_micro-batches loss_sum) / N,   N = Σ tokens with shift_labels ≠ -100.

Under SP each rank holds a disjoint shard of each sample, so ranks see different token counts; averaging
per-rank mean losses would weight a shard with 3 labelled tokens like one with 3000 (ALST 4.3: combine
weighted by the count). Instead:

1. Before the first forward of the window, `global_token_count` sums the local counts of all the
   window's micro-batch shards and all-reduces them over the world: N (an integer, no gradient).
2. Each rank backpropagates `loss_sum / N` for each of its micro-batches (`local_objective`).
3. Gradients are summed over the whole world (SP ranks and DP ranks) and over the window.

Why that is exact: the SP ranks together run one distributed graph — the Ulysses all-to-alls connect
them, and their backward is again an all-to-all. Seeding rank r's backward with its own term ℓ_r/N is
the same as seeding that single graph with Σ_r ℓ_r/N = L (backward is linear in the seed), so every
rank ends up holding, for each parameter, the part of ∂L/∂θ that flows through its own uses of θ;
summing over ranks gives ∂L/∂θ. No collective is needed inside the loss, so nothing extra is kept for
backward (ALST's variant all-gathers the per-rank losses differentiably and lets DeepSpeed undo the
resulting factor sp; same numbers, one more collective).

DeepSpeed sums gradients over its SP group and averages over DP, so `DeepSpeedEngine.backward`
multiplies by the DP degree to turn that average into the sum step 3 needs. The reported loss (and the
evaluation loss) is `global_mean`: all-reduced loss sums over all-reduced counts — the exact mean.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable

from lstune.parallel.comm import Communicator
from lstune.parallel.sp_data import count_tokens

if TYPE_CHECKING:
    import torch


def global_token_count(micro_batches: Iterable[dict[str, "torch.Tensor"]], group: Any = None) -> int:
    """Loss-carrying tokens of the whole global batch: local shards' counts all-reduced over `group`.

    Pass every micro-batch (shard) this rank will process in the accumulation window; `group` None is
    the world, which is right for SP × DP (SP ranks hold disjoint shards, DP ranks different samples).
    A single process needs no torch.distributed. Call it on every rank (it is a collective).
    """
    local = sum(count_tokens(mb) for mb in micro_batches)
    return int(round(Communicator.of(group).sum([float(local)])[0]))


def local_objective(loss_sum: "torch.Tensor", n_tokens_global: int) -> "torch.Tensor":
    """This rank's share of the global mean loss for one micro-batch; backpropagate exactly this.

    With gradients summed over ranks and micro-batches (see the module docstring) the result is the
    gradient of the global mean. A window with no labelled token gives 0 (and zero gradients), not NaN; the
    training step does not run such a window at all (lstune.train.step: no optimizer step on zero gradients).
    """
    return loss_sum / max(n_tokens_global, 1)


def global_mean(loss_sums: Iterable[float], n_tokens: Iterable[int], group: Any = None) -> float:
    """The exact mean loss over all ranks: (Σ loss sums) / (Σ token counts), both all-reduced.

    For reporting training loss (pass the window's detached loss sums and counts) and for evaluation
    (pass every eval batch's). Call it on every rank.
    """
    total, count = Communicator.of(group).sum([float(sum(float(x) for x in loss_sums)), float(sum(n_tokens))])
    return total / count if count else float("nan")


def sum_gradients(parameters: Iterable["torch.nn.Parameter"], group: Any = None) -> None:
    """All-reduce (sum) every parameter's gradient over `group`: step 3 for training without DeepSpeed.

    DeepSpeed does this itself; this is for plain torch.distributed training and for tests.
    """
    import torch.distributed as dist

    for p in parameters:
        if p.grad is not None:
            dist.all_reduce(p.grad, group=group)
