"""One optimizer step: a window of micro-batches, the exact global mean loss, and its metrics record.

The objective of a step is the mean token loss over every loss-carrying token of the window on every
rank: each micro-batch backpropagates `loss_sum / N` with N the window's global token count, counted
before the first forward (lstune.parallel.loss). So grad-accumulated micro-steps equal one large batch,
and SP = N equals SP = 1.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator


@dataclass
class RunState:
    step: int = 0
    consumed_samples: int = 0  # global: over every rank, the position in the data stream
    tokens_seen: int = 0


class Stepper:
    """Runs optimizer steps of `engine` with `loss_sum(batch, model)` (a PreparedModel's loss head)."""

    def __init__(self, config, engine, runtime, loss_sum: Callable[..., tuple[Any, Any]], phases=None):
        self.phases = phases  # a lstune.train.phases.PhaseTracker, or None
        self.config = config
        self.engine = engine
        self.runtime = runtime
        self.loss_sum = loss_sum
        # Each SP round holds one micro-batch from every rank of the group: sp micro-batches per round.
        self.micro_batches = config.optim.grad_accum * runtime.sp
        self.samples_per_step = config.optim.micro_batch_size * config.optim.grad_accum * runtime.world_size

    def step(self, batches: Iterator[dict], state: RunState) -> dict[str, Any]:
        from lstune.parallel.loss import global_token_count, local_objective
        from lstune.train.metrics import host_rss_bytes, peak_device_mem_bytes, reset_peak

        device = self.runtime.device
        reset_peak(device)
        start = time.perf_counter()
        window = [next(batches) for _ in range(self.micro_batches)]
        n_global = global_token_count(window)
        local_loss = 0.0
        times = {"forward_s": 0.0, "backward_s": 0.0}
        for batch in window:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            with self._phase("forward", times, device), self._autocast():
                loss_sum, _ = self.loss_sum(batch, self.engine.model)
            with self._phase("backward", times, device):
                self.engine.backward(local_objective(loss_sum, n_global))
            local_loss += float(loss_sum.detach())
        local_tokens = sum(int(b["input_ids"].numel()) for b in window)
        loss_total, tokens = self.runtime.sum([local_loss, float(local_tokens)])
        loss = loss_total / n_global if n_global else float("nan")
        times["optimizer_s"] = 0.0
        with self._phase("optimizer", times, device):
            stats = self._update(loss)
        elapsed = time.perf_counter() - start

        tokens = int(tokens)
        state.step += 1
        state.consumed_samples += self.samples_per_step
        state.tokens_seen += tokens
        return {
            "step": state.step,
            "loss": loss,
            "update_skipped": stats.get("update_skipped", False),
            "tokens": tokens,
            "label_tokens": n_global,
            "tokens_per_s": tokens / elapsed,
            "step_time_s": elapsed,
            "lr": stats["lr"],
            "grad_norm": stats["grad_norm"],
            "peak_device_mem_bytes": peak_device_mem_bytes(device),
            "host_rss_bytes": host_rss_bytes(),
            "tokens_seen": state.tokens_seen,
            **times,
        }

    @contextlib.contextmanager
    def _phase(self, name: str, times: dict[str, float], device):
        """Time a phase of the step into `times[name + "_s"]` (synchronised on CUDA, whose calls return early)."""
        import torch

        if self.phases is not None:
            self.phases.set(name)
        begin = time.perf_counter()
        yield
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times[f"{name}_s"] += time.perf_counter() - begin

    def _update(self, loss: float) -> dict[str, Any]:
        """The optimizer step, unless the loss is not finite: then the engine's `skip_step` (the single-device
        engine drops the gradients; DeepSpeed drops them when they are not finite, lstune.parallel.engine_ds),
        whose `update_skipped` says whether the weights stayed as they were (lstune.train.guard decides)."""
        return self.engine.step() if math.isfinite(loss) else self.engine.skip_step()

    def _autocast(self):
        import torch

        dtype = self.runtime.autocast_dtype
        return torch.autocast(self.runtime.device.type, dtype=dtype or torch.float32, enabled=dtype is not None)
