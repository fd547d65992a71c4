"""The estimate's view of the checkpoint placement (lstune.memory.placement): the same planner on the same
numbers train gives it, so `lstune estimate` predicts the plan `lstune train` prints.

`checkpoint_terms` is the one call the byte model makes (lstune.estimate.memory); it returns the checkpoint
bytes on the host and on the device (in checkpoints, at the forward's end and in backward) and the placement,
which the step's FLOPs read for the layers backward re-runs (`extra_layer_forwards`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from lstune.estimate.shapes import ModelShape
from lstune.memory.offload_math import forget_sizes, place_checkpoints
from lstune.memory.placement import CheckpointPlacement


@dataclass(frozen=True)
class CheckpointTerms:
    placement: CheckpointPlacement | None  # None: no offloader (every checkpoint on the device, as before)
    offloaded: int  # layers with a host part
    host: int  # host bytes
    kept_fwd: float  # device checkpoints held between forward and backward (in checkpoints; α makes fractions)
    kept_bwd: float  # ... at a layer's backward: plus the one fetched back and a recomputed segment's inputs


def checkpoint_terms(shape: ModelShape, s: Any, ckpt: int, element_size: int) -> CheckpointTerms:
    """Where the `shape.layers` checkpoints of `ckpt` bytes each live under `s` (lstune.estimate.memory.Settings,
    not imported: that module imports this one)."""
    device_budget = s.checkpoint_device_budget
    if not s.offload_checkpoints and device_budget is None:
        return CheckpointTerms(None, 0, 0, shape.layers, shape.layers)
    placement = planned_placement(shape, s, ckpt, element_size, device_budget)
    kept_fwd = placement.device_bytes() / ckpt if ckpt else shape.layers
    kept_bwd = placement.device_peak_bytes() / ckpt if ckpt else shape.layers
    offloaded = sum(1 for a in placement.host_fraction if a)
    return CheckpointTerms(placement, offloaded, placement.host_bytes(), kept_fwd, kept_bwd)


def planned_placement(shape: ModelShape, s: Any, ckpt: int, element_size: int,
                      device_budget: int | None) -> CheckpointPlacement:
    """`place_checkpoints` on the inputs train gives it (lstune.memory.apply.checkpoint_placement), from the
    config's shapes: the host budget (none without offload), the device budget, the copy that hides on CUDA."""
    return _placed(shape.layers, ckpt, s.local_tokens // max(s.micro_batch, 1), shape.layer_matmul_params(),
                   shape.q_width, element_size, s.on_cuda, s.host_mem_budget if s.offload_checkpoints else 0,
                   device_budget)


@lru_cache(maxsize=1 << 14)  # the length searches plan the same few thousand placements again for each engine
def _placed(layers: int, ckpt: int, tokens: int, layer_matmul_params: int, attention_width: int, element_size: int,
            on_cuda: bool, host_budget: int | None, device_budget: int | None) -> CheckpointPlacement:
    return place_checkpoints(
        layers, ckpt, tokens=tokens, layer_matmul_params=layer_matmul_params, attention_width=attention_width,
        element_size=element_size, on_cuda=on_cuda, host_budget=host_budget, device_budget=device_budget,
    )


def cache_clear() -> None:
    """Forget the placements and the host sizes they remembered (lstune.estimate.memory.forget_byte_models)."""
    _placed.cache_clear()
    forget_sizes()


def extra_layer_forwards(placement: CheckpointPlacement | None) -> int:
    """Layer forwards backward adds for checkpoints not stored (0 without a placement)."""
    return placement.extra_layer_forwards() if placement is not None else 0


def placement_summary(placement: CheckpointPlacement | None, flops) -> dict | None:
    """The plan as train prints it, with the extra recompute in % of the step's FLOPs (`flops`: StepFlops)."""
    if placement is None:
        return None
    out = placement.summary()
    out["extra_recompute_pct"] = round(100 * flops.recompute_extra / flops.hardware, 2) if flops.hardware else 0.0
    return out
