"""Host↔device copies of one step, per rank: what offloaded checkpoints and offloaded attention chunks move over the
host link, and the seconds the chunks' copies add where the attention they serve cannot hide them.

Checkpoints: each one on the host goes out in forward and comes back in backward (their copies hide under a layer's
forward from `offload_min_tokens` tokens on, MEMO Eq. 1, so no time is added for them). Attention chunks (FPDT, with
offload): `lstune.memory.attention_chunks.offload_copy_bytes`, the store's own count (checked against the copies the
store makes in tests/unit/memory/test_attention_chunks.py), for every layer, with flash-kernel blocks on CUDA. Their copies run on side streams under
the attention kernels; the step time adds what is left when the busier direction's copies take longer than the
step's attention at the device's rate — chunks shorter than `--attn-chunks auto`'s hiding length pay this.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from lstune.estimate.flops import StepFlops
from lstune.estimate.hardware import Cluster
from lstune.estimate.memory import Breakdown, Settings
from lstune.estimate.shapes import ModelShape


@dataclass(frozen=True)
class StepCopies:
    checkpoint_bytes: int = 0  # offloaded checkpoints, out and back
    chunk_out_bytes: int = 0  # attention chunks, device → host
    chunk_in_bytes: int = 0  # attention chunks, host → device
    exposed_seconds: float = 0.0  # chunk copies the step's attention does not hide

    def to_dict(self) -> dict:
        return asdict(self)


def step_copies(shape: ModelShape, s: Settings, b: Breakdown, flops: StepFlops, hardware: Cluster,
                chunks: int) -> StepCopies:
    """The copies of one micro-batch of one rank (module doc; the estimate counts them for each micro-batch of a
    step); `flops` of one micro-batch, `chunks` the attention chunks."""
    checkpoint = 2 * b.placement.host_bytes() if b.placement is not None else 0
    if chunks <= 1 or not s.offload_checkpoints:
        return StepCopies(checkpoint)
    from lstune.memory.offload_math import offload_copy_bytes

    # On CUDA the blocks of a long document take the flash kernel (attention_blocks.block_kind; packed documents'
    # boundary blocks do not, and copy a little less).
    out, into = offload_copy_bytes(s.local_tokens, chunks, shape.q_width, shape.kv_width, shape.heads,
                                   b.dtypes["act"], forward_runs=2 if s.checkpointing else 1, flash=s.on_cuda)
    out, into = out * shape.layers, into * shape.layers
    device = hardware.device
    attention = flops.hardware_attention / s.sp / (device.attention_tflops * 1e12)
    exposed = max(0.0, max(out, into) / (device.host_link_gbps * 1e9) - attention)
    return StepCopies(checkpoint, out, into, exposed)
