"""Rank-local parameters beside a DeepSpeed engine: tensors each SP rank holds its own shard of (METP's MLP weights,
lstune.memory.metp_mlp), which the model does not register, so DeepSpeed never broadcasts, all-reduces or
partitions them.

Why by hand: DeepSpeed's mechanism for weights that differ between ranks is its expert parallelism (`allreduce=False`
parameters in `moe` optimizer groups, reduced over expert-data-parallel groups), which it switches on only for models
holding its own `MoE` layers, and whose checkpoints are written per expert of those layers; and ZeRO-3 partitions every
registered parameter over its whole group. So these shards stay outside it, and this class does for them what the
engine does for the rest, in the same step, with the same numbers:

- gradients summed over the shard's true replicas only — the ranks at the same SP position of every SP group
  (`ParallelDims.dp_group`) — and divided by the factor the loop multiplied every loss by
  (engine_ds.gradient_divisor), so each shard's gradient is the global sum, as DeepSpeed's reduction makes it for the
  replicated parameters;
- their squared norm, summed over the SP group (every shard once), joins DeepSpeed's own norm
  (`DeepSpeedEngine` hands it in), so clipping sees the one-process norm and scales these by the same factor;
- their own torch AdamW with the engine's settings, at the learning rate the engine's schedule gives each step;
- their values and Adam state saved per rank beside DeepSpeed's checkpoint (`state_dict`), resumed under the same
  layout only (lstune.train.preflight.check_resume_layout refuses another).
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any, Callable

from lstune.optim import OptimConfig, make_adamw

if TYPE_CHECKING:
    import torch

    from lstune.parallel.dims import ParallelDims


class LocalParams:
    """`params`: this rank's shards (those that train); `full_weights`: a context manager (a collective) under which
    the model holds the full weights as ordinary parameters, for export."""

    def __init__(self, params: list["torch.nn.Parameter"], dims: "ParallelDims", optim: OptimConfig,
                 full_weights: Callable[[], AbstractContextManager] = nullcontext):
        self.params = [p for p in params if p.requires_grad]
        self.dims = dims
        self.optim = optim
        self.full_weights = full_weights
        self.optimizer = make_adamw(self.params, optim) if self.params else None
        self.norm: "torch.Tensor | None" = None  # this step's, after `reduce`

    def reduce(self, divisor: int) -> "torch.Tensor | None":
        """Sum the gradients over the shards' replicas, undo the loop's `divisor`; returns (and keeps) the norm of
        every shard's gradient over the SP group (a collective on every rank); None when none trains."""
        import torch
        import torch.distributed as dist

        if not self.params:
            return None
        for p in self.params:
            if p.grad is None:  # every rank takes part in every reduction, in the same order
                p.grad = torch.zeros_like(p)
        grads = [p.grad for p in self.params]
        for grad in grads:
            if self.dims.dp > 1:
                dist.all_reduce(grad, group=self.dims.dp_group)
            grad.div_(divisor)
        squares = torch.zeros((), dtype=torch.float32, device=self._device())
        for grad in grads:
            squares += grad.float().pow(2).sum()
        if self.dims.sp > 1:
            dist.all_reduce(squares, group=self.dims.sp_group)
        self.norm = squares.sqrt()
        return self.norm

    def step(self, lr: float, total_norm: float) -> None:
        """Clip by `total_norm` (every parameter's, as the engine clipped the rest) and update at `lr`."""
        if self.optimizer is None:
            return
        max_norm = self.optim.max_grad_norm
        if max_norm > 0:
            # DeepSpeed's factor (ZeRO's unscale_and_clip_grads) — torch's clip_grad_norm_ uses the same one
            scale = 1.0 / max(1.0, (total_norm + 1e-6) / max_norm)
            for p in self.params:
                if p.grad is not None:
                    p.grad.mul_(scale)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self.zero_grad()

    def zero_grad(self) -> None:
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)
        self.norm = None

    def state_dict(self) -> dict[str, Any]:
        return {"params": [p.detach().cpu() for p in self.params],
                "optimizer": self.optimizer.state_dict() if self.optimizer is not None else None}

    def load_state_dict(self, state: dict[str, Any], where: str) -> None:
        """Values and Adam state saved by `state_dict` under the same layout; ValueError naming `where` otherwise."""
        import torch

        saved = state.get("params", [])
        if len(saved) != len(self.params) or any(s.shape != p.shape for s, p in zip(saved, self.params)):
            raise ValueError(f"{where} holds {len(saved)} rank-local tensors, this run {len(self.params)} of other "
                             "shapes")
        with torch.no_grad():
            for param, value in zip(self.params, saved):
                param.copy_(value)
        if self.optimizer is not None:
            self.optimizer.load_state_dict(state["optimizer"])
            for group in self.optimizer.param_groups:
                group.update(betas=tuple(self.optim.betas), eps=self.optim.eps, weight_decay=self.optim.weight_decay)

    def _device(self):
        return self.params[0].device
