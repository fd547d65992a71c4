"""METP Table 1 with lstune's numbers: one layer's MLP on one rank under METP's MLP (--metp-mlp) and under ZeRO-3 +
tiled MLP — the training state held, the working set in the layer's backward, the bytes moved per micro-batch —
from the byte model's own terms (METP's: lstune.estimate.sequence_parallel; the tiled MLP's and ZeRO's:
lstune.estimate.memory), PREDICTED. Printed by `lstune estimate --metp-mlp` (lstune.estimate.prediction.sp_report)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from lstune.estimate.memory import DS_GRAD_BYTES, DS_OPTIM_BYTES, mlp_tile_working_bytes
from lstune.estimate.sequence_parallel import metp_moment_bytes, metp_state_bytes


@dataclass(frozen=True)
class MlpComparison:
    """One layer's MLP on one rank, METP's MLP vs ZeRO-3 + tiled MLP (PREDICTED, the byte model's own terms): the
    training state the rank holds for it (weights, gradients, optimizer state), its working set at the peak of the
    layer's backward, and bytes moved per micro-batch — METP Table 1's rows with lstune's numbers."""

    metp_weights: int
    metp_peak: int
    metp_moved: int
    zero3_weights: int
    zero3_peak: int
    zero3_moved: int

    def to_dict(self) -> dict:
        return asdict(self)


def mlp_comparison(shape: Any, *, seq_len: int, micro_batch: int, sp: int, world: int, tiles: int,
                   param_bytes: int = 2, act_bytes: int = 2, trainable: bool = True,
                   checkpointing: bool = True) -> MlpComparison:
    """Per layer and rank (`metp_state_bytes`, `metp_moment_bytes`; lstune.estimate.memory's tiled-MLP terms).
    METP: its shard's state (1/p of the MLP, fp32 masters, gradients and AdamW when trained) and its backward's
    working set; moves (p−1)/p of the MLP per weight pass (forward, the checkpoint's re-run, backward) in the tokens'
    dtype and once more as fp32 gradient sums (`sp_traffic`). ZeRO-3 + tiled MLP: its 1/world partition of weights,
    fp32 gradients and master + m + v, the gathered layer's MLP (and the one prefetched) in `param_bytes`, one tile's
    working set ((s/p/tiles) tokens × I); moves (world−1)/world of the MLP per all-gather (one per weight pass) and
    per gradient reduce-scatter."""
    weights = (3 if shape.gated else 2) * shape.hidden * shape.intermediate
    t = micro_batch * seq_len // sp
    passes = 3 if checkpointing else 2
    metp_state = sum(metp_state_bytes(shape, sp, trainable=trainable, frozen_bytes=param_bytes))
    zero3_state = weights * (param_bytes + (DS_GRAD_BYTES + DS_OPTIM_BYTES if trainable else 0)) // world
    return MlpComparison(
        metp_weights=metp_state,
        metp_peak=sum(metp_moment_bytes(shape, tokens=t, sp=sp, act_bytes=act_bytes).values()),
        metp_moved=int((sp - 1) / sp * weights * (act_bytes * passes + (4 if trainable else 0))),
        zero3_weights=zero3_state + 2 * weights * param_bytes,
        zero3_peak=mlp_tile_working_bytes(shape, tokens=-(-t // max(1, tiles)), act_bytes=act_bytes),
        zero3_moved=int((world - 1) / world * weights * param_bytes * (passes + (1 if trainable else 0))),
    )

