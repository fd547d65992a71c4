"""One optimizer step: a window of micro-batches, the exact global mean loss, and its metrics record.

The objective of a step is the mean token loss over every loss-carrying token of the window on every
rank: each micro-batch backpropagates `loss_sum / N` with N the window's global token count, counted
before the first forward (lstune.parallel.loss). So grad-accumulated micro-steps equal one large batch,
and SP = N equals SP = 1.

A window with N = 0 (no loss-carrying token on any rank) has no mean loss and nothing to learn: it is
not run, and its update is skipped so that weights and optimizer state are exactly as if it did not
exist (`Stepper._skip_empty_window`); its record says so (loss NaN, label_tokens 0, update_skipped) and
lstune.train.guard reports it as such, not as divergence.
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
        from lstune.parallel.loss import global_token_count
        from lstune.train.metrics import host_rss_bytes, peak_device_mem_bytes, reset_peak

        device = self.runtime.device
        reset_peak(device)
        start = time.perf_counter()
        window = [next(batches) for _ in range(self.micro_batches)]
        n_global = global_token_count(window)  # the same on every rank, so every rank takes the same branch
        times = {"forward_s": 0.0, "backward_s": 0.0}
        local_loss = self._forward_backward(window, n_global, times) if n_global else 0.0
        local_tokens = sum(int(b["input_ids"].numel()) for b in window)
        loss_total, tokens = self.runtime.sum([local_loss, float(local_tokens)])
        loss = loss_total / n_global if n_global else float("nan")
        times["optimizer_s"] = 0.0
        with self._phase("optimizer", times, device):
            stats = self._update(loss) if n_global else self._skip_empty_window()
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

    def _forward_backward(self, window: list[dict], n_global: int, times: dict[str, float]) -> float:
        """Backpropagate each micro-batch's share of the window's mean loss; this rank's summed token loss."""
        from lstune.parallel.loss import local_objective

        device = self.runtime.device
        local_loss = 0.0
        for batch in window:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            with self._phase("forward", times, device), self._autocast():
                loss_sum, _ = self.loss_sum(batch, self.engine.model)
            with self._phase("backward", times, device):
                self.engine.backward(local_objective(loss_sum, n_global))
            local_loss += float(loss_sum.detach())
        return local_loss

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

    def _skip_empty_window(self) -> dict[str, Any]:
        """No optimizer step for a window without a loss-carrying token. Stepping on its (zero) gradients would
        not leave things as they were: AdamW's weight decay and momentum still move the weights and its moments
        and step count advance, and DeepSpeed's `skip_step` applies an update when gradients are finite. So
        neither engine method is called; only the learning-rate schedule advances, as for any skipped step
        (lstune.train.engine.TorchEngine.skip_step), so the run keeps its planned length and schedule. No
        backward ran, and the previous step left no gradients (both engines zero them when they step)."""
        from lstune.optim import advance_schedule

        return {"grad_norm": 0.0, "lr": advance_schedule(self.engine.scheduler), "update_skipped": True}

    def _autocast(self):
        import torch

        dtype = self.runtime.autocast_dtype
        return torch.autocast(self.runtime.device.type, dtype=dtype or torch.float32, enabled=dtype is not None)
