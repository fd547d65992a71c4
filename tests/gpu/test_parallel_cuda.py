"""Ulysses on one GPU: SP=1 through the Ulysses wrapper gives the plain path's loss, and what it costs.

SP=1 skips the collectives but runs everything else of the wrapper (head plan, position handling, the
kernel call through the attention interface), so any numeric or dispatch difference shows up here;
`time_forward_backward` is the helper benchmarks use to compare the two paths side by side.
"""

from __future__ import annotations

import time

import pytest

pytestmark = pytest.mark.gpu


def time_forward_backward(model, batch: dict, *, reps: int = 5) -> tuple[float, float]:
    """(loss, median seconds of forward + backward) of `model` on `batch` (on CUDA, synchronised)."""
    import statistics

    import torch

    from lstune.memory.loss import causal_lm_loss_sum

    times, loss = [], None
    for _ in range(reps + 1):
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        start = time.perf_counter()
        total, n = causal_lm_loss_sum(model, batch)
        (total / n).backward()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        loss = (total / n).item()
    return loss, statistics.median(times[1:])


def _batch(seq: int, docs: int):
    import torch

    from tests.distributed._helpers import make_batch

    return {k: v.cuda() for k, v in make_batch(seq, seed=1, docs=docs).items()}


@pytest.mark.parametrize("docs", [1, 4])
def test_ulysses_sp1_matches_the_plain_path_on_cuda(docs):
    import torch

    from lstune.models.attention import use_lstune_attention
    from lstune.models.presets import build_model
    from lstune.parallel.dims import ParallelDims
    from lstune.parallel.ulysses import apply_ulysses

    batch = _batch(4096, docs)
    model = build_model("tiny-llama", dtype=torch.bfloat16).cuda()
    use_lstune_attention(model)
    plain_loss, plain_s = time_forward_backward(model, batch)
    plain_grads = [p.grad.clone() for p in model.parameters()]

    handle = apply_ulysses(model, ParallelDims(1, 1))
    sp_loss, sp_s = time_forward_backward(model, batch)
    handle.undo()

    assert sp_loss == plain_loss
    for p, g in zip(model.parameters(), plain_grads):
        torch.testing.assert_close(p.grad, g, rtol=0, atol=0)
    print(f"docs={docs}: plain {plain_s * 1e3:.1f} ms, Ulysses SP=1 {sp_s * 1e3:.1f} ms")
