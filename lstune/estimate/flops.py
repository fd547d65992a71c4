"""FLOPs of one training step of one sequence: the model's (the MFU numerator) and the hardware's.

Per token and layer, a matmul of a `[in, out]` weight costs 2·in·out FLOPs forward. Backward costs the input
gradient (2·in·out) and, for trainable weights, the weight gradient (2·in·out): a frozen LoRA base costs
forward + input gradient only; its adapters r·(in + out) cost all three. Causal attention computes S(S+1)/2
(query, key) pairs per layer (fewer inside a sliding window), 4·head_dim·heads FLOPs per pair forward (QKᵀ and
PV), twice that backward — in the layers with softmax attention only (a hybrid's linear-attention and state-space
layers, `ModelShape.mixers`, cost their recurrence, 4 FLOPs per state element and token, linear in length).

`model` is the MFU numerator: forward + backward, no recompute. `hardware` adds what lstune runs again:
checkpointing's second forward of every layer, the tiled MLP's recompute of each tile in backward, the tiled
loss head's recompute of the logits, attention kernels' own backward recompute (FlashAttention's backward
is 2.5 × its forward, the convention of the rates in lstune.estimate.hardware) — checkpointing's second forward
leaves attention out for layers that keep its output (`--recompute-attention off`) —, and under chunked attention
(FPDT, lstune.memory.attention_chunks) two more forwards of the attention block's projections (q, k, v, o and their
adapters): it runs them per chunk in forward, once to replay the output gradient and once to backpropagate.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from lstune.estimate.shapes import ModelShape

ATTENTION_BACKWARD = 2.0  # model FLOPs: dQ, dK, dV, dP
ATTENTION_BACKWARD_KERNEL = 2.5  # what a FlashAttention-class backward computes (recomputes P)


@dataclass(frozen=True)
class StepFlops:
    """FLOPs of `tokens` tokens, all layers, all ranks of an SP group together: `step_flops`' of one sequence, the
    estimate's of one optimizer step (its micro-batches, lstune.estimate.micro_batches_per_step)."""

    model: float  # MFU numerator
    hardware: float  # with recompute
    hardware_matmul: float  # the part of `hardware` that runs as dense matmuls
    hardware_attention: float  # the part that runs in attention kernels
    tokens: int
    recompute_extra: float = 0.0  # the part of `hardware` for checkpoints not stored (lstune.memory.placement)

    def to_dict(self) -> dict:
        return asdict(self)


def step_flops(
    model_config: Any, seq_len: int, *, lora: bool, checkpointing: bool, lora_r: int = 16,
    tiled_mlp: bool = False, tiled_loss: bool = False, extra_layer_forwards: int = 0, attn_chunked: bool = False,
    attention_saved_layers: int = 0,
) -> StepFlops:
    """FLOPs of a step over one sequence of `seq_len` tokens (module doc). `lora`: LoRA of rank `lora_r` on every
    linear layer but the head (adapter FLOPs are r·(in + out) per linear); `tiled_mlp` / `tiled_loss`: their
    recompute counts in `hardware`; `extra_layer_forwards`: layers whose checkpoint is not stored, re-run once more in
    backward (lstune.memory.placement); `attn_chunked`: attention in chunks (module doc); `attention_saved_layers`:
    checkpointed layers whose attention output is kept (`--recompute-attention off`, lstune.memory.attention_saved):
    their recompute runs no attention forward."""
    shape = ModelShape.from_config(model_config)
    s = seq_len
    layer_fwd = 2 * shape.layer_matmul_params() * s * shape.layers
    head_fwd = 2 * shape.hidden * shape.vocab * s
    attention_fwd = _attention_forward(shape, s)
    layer_fwd += shape.linear_mixer_flops(s)  # linear-attention / SSM recurrences: linear in length
    adapter_fwd = 2 * lora_r * _adapter_widths(shape) * s * shape.layers if lora else 0
    base_backward = 1 if lora else 2
    matmul_model = (layer_fwd + head_fwd) * (1 + base_backward) + 3 * adapter_fwd
    model = matmul_model + attention_fwd * (1 + ATTENTION_BACKWARD)
    recompute = 0.0
    if checkpointing:
        recompute += layer_fwd + adapter_fwd
    if tiled_mlp:
        recompute += 2 * shape.mlp_matrices * shape.hidden * shape.active_intermediate * s * shape.layers
    if tiled_loss:
        recompute += head_fwd
    if attn_chunked:
        projections = 2 * shape.hidden * (2 * shape.q_width + 2 * shape.kv_width) * s * shape.layers
        adapters = 2 * lora_r * _attention_adapter_widths(shape) * s * shape.layers if lora else 0
        recompute += 2 * (projections + adapters)
    # Not stored: one more forward of the layer (its matmuls and adapters, and its share of the attention).
    placed = extra_layer_forwards / shape.layers
    extra = placed * (layer_fwd + adapter_fwd + attention_fwd)
    recompute += placed * (layer_fwd + adapter_fwd)
    # A hybrid's attention forward is its softmax layers' alone (issue 34b), and only those keep an output.
    softmax_layers = sum(m in ("attention", "hybrid") for m in shape.mixers) if shape.mixers else shape.layers
    rerun = 1 - min(attention_saved_layers, softmax_layers) / max(softmax_layers, 1) if checkpointing else 0
    attention_hw = attention_fwd * (1 + ATTENTION_BACKWARD_KERNEL + rerun + placed)
    matmul_hw = matmul_model + recompute
    return StepFlops(float(model), float(matmul_hw + attention_hw), float(matmul_hw), float(attention_hw), s,
                     float(extra))


def attention_split(flops: StepFlops, model_config: Any, seq_len: int) -> tuple[float, float]:
    """(forward-kind, backward) parts of `flops.hardware_attention`, so that each can be timed at its own kernel's
    rate (lstune.bench's ideal step). step_flops counts attention in forwards A of one sequence: the forward, the
    kernel's backward (ATTENTION_BACKWARD_KERNEL·A), checkpointing's second forward, the placement's share of one
    more; all but the backward run the forward kernel. `flops` holds `flops.tokens / seq_len` sequences (the
    estimate's: those of one optimizer step)."""
    sequences = flops.tokens / seq_len
    backward = ATTENTION_BACKWARD_KERNEL * _attention_forward(ModelShape.from_config(model_config), seq_len) * sequences
    return flops.hardware_attention - backward, backward


@dataclass(frozen=True)
class KernelFlops:
    """A step's FLOPs by the kernel that runs them, so that each part can be timed at its kernel's rate."""

    matmul: float
    attention_forward: float
    attention_backward: float  # the kernel's backward, P recomputed: 2.5 forwards (ATTENTION_BACKWARD_KERNEL)

    def ideal_seconds(self, gemm: float, attention_forward: float, attention_backward: float) -> float:
        """At these rates (FLOP/s), back to back: the step's kernels and nothing else."""
        return (self.matmul / gemm + self.attention_forward / attention_forward
                + self.attention_backward / attention_backward)


def kernel_flops(flops: StepFlops, model_config: Any, seq_len: int) -> tuple[KernelFlops, KernelFlops]:
    """`flops` by kernel two ways: (as lstune runs the step, recompute counted: `hardware`'s matmuls and attention
    forwards; the step with no recompute at all: `model`'s matmuls, one attention forward). Both keep the attention
    kernel's own backward (2.5 forwards): no FlashAttention-class kernel runs without recomputing P. The "× ideal" of
    lstune.bench.metrics and the estimate divide a step by each: the first says what the step spends beyond its
    kernels, the second also what its recompute costs."""
    forward, backward = attention_split(flops, model_config, seq_len)
    once = backward / ATTENTION_BACKWARD_KERNEL
    return (KernelFlops(flops.hardware_matmul, forward, backward),
            KernelFlops(flops.model - (1 + ATTENTION_BACKWARD) * once, once, backward))


def _attention_forward(shape: ModelShape, seq_len: int) -> int:
    """One forward of causal attention over one sequence, all layers: QKᵀ and PV, 2·head_dim FLOPs each per
    (query, key) pair and head."""
    return 4 * shape.head_dim * shape.heads * shape.attention_pairs(seq_len)


def _adapter_widths(shape: ModelShape) -> int:
    """Σ (in + out) over the linear layers of one decoder layer that LoRA 'auto' adapts (dense experts counted
    as the MLP a token passes through)."""
    return _attention_adapter_widths(shape) + shape.mlp_matrices * (shape.hidden + shape.active_intermediate)


def _attention_adapter_widths(shape: ModelShape) -> int:
    h = shape.hidden
    return (h + shape.q_width) + 2 * (h + shape.kv_width) + (shape.q_width + h)
