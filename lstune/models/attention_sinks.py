"""Learned attention sinks (gpt-oss), exact from any attention that returns its log-sum-exp — no special kernel.

A sink is one learned logit s_h per head that joins every query row's softmax and carries no value (HF's eager
gpt-oss concatenates it as an extra column and drops its probability after the softmax). Given the output O and
log-sum-exp lse of a row over its real keys:

    lse' = logaddexp(lse, s_h)            (the softmax's normaliser with the sink)
    O'   = O · exp(lse − lse') = O · sigmoid(lse − s_h)

Backward, with P' = exp(S − lse') the probabilities with the sink and delta' = rowsum(dO' ∘ O'):
- q, k, v: FlashAttention's backward run with (O', lse') in place of (O, lse) is exactly the gradient — it computes
  dS = P' ∘ (dO'·Vᵀ − delta'), which is the softmax gradient of the row with the sink (the sink's value is 0, so it
  adds nothing to dO'·Vᵀ; its probability is in the normaliser only). Chunked attention and ring attention keep
  their backward unchanged and hand it the sink-applied (O', lse').
- the sink: ds_h = Σ_rows P'_sink · (0 − delta') = −Σ_rows exp(s_h − lse') · delta' (`sink_gradient`).
The same follows from differentiating `apply_sinks` with autograd (checked in tests/unit/models/test_attention_sinks.py).

Apply it ONCE per query row, after every key block has been merged (online softmax), never per block: the sink is
one extra column of the whole row. Under Ulysses each rank applies its own heads' slice of the sinks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from torch import Tensor


def apply_sinks(out: Tensor, lse: Tensor, sinks: Tensor) -> tuple[Tensor, Tensor]:
    """(O', lse') from the merged (O [..., t, D], lse [..., t]) over the real keys and the sink logits, broadcastable
    to lse (e.g. [1, H, 1] for lse [B, H, t]). Rows with no real key (lse = -inf) get O' = 0 and lse' = s.
    Differentiable with autograd; kernels with their own backward use (O', lse') and `sink_gradient`."""
    sinks = sinks.to(lse.dtype)
    total = torch.logaddexp(lse, sinks)
    return out * torch.exp(lse - total).to(out.dtype)[..., None], total


def sink_gradient(lse: Tensor, delta: Tensor, sinks: Tensor) -> Tensor:
    """Each row's contribution to the sink logits' gradient, shaped like lse: −exp(s − lse')·delta', from the
    sink-applied lse' and the rowsums delta' = rowsum(dO' ∘ O') that FlashAttention's backward uses (`rowsums`).
    Sum it over the rows (and batch) of each head."""
    return -torch.exp(sinks.to(lse.dtype) - lse) * delta


def rowsums(out: Tensor, dout: Tensor) -> Tensor:
    """delta = rowsum(dO ∘ O) in fp32, shaped like the lse."""
    return (dout.float() * out.float()).sum(-1)


def grouped_sinks(sinks: Tensor, kv_heads: int) -> Tensor:
    """Sink logits [H] as fp32 constants [1, H_kv, H/H_kv, 1], broadcastable to the grouped-query lse [B, H_kv, g, t]
    of lstune's block kernels (query head h uses kv head h // (H/H_kv), as HF's repeat_kv)."""
    return sinks.detach().float().reshape(1, kv_heads, -1, 1)


def head_sinks(sinks: Tensor | None, start: int, count: int) -> Tensor | None:
    """The sinks of query heads [start, start + count) — a rank's slice under Ulysses (uneven head plans too)."""
    return None if sinks is None else sinks[start:start + count]
