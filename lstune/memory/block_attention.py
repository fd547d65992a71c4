"""Whole-sequence attention from chunked attention's block kernels (`attention_blocks`), for what lstune's attention
backends cannot do themselves: learned attention sinks (gpt-oss; any device and backend) and softcapped logits on a
device with no softcapping kernel that trains (Gemma-2 on CPU, where flex has no backward).

Steps (one autograd Function per attention call, on the full-sequence q/k/v the attention function got — under
Ulysses a rank's heads of the whole sequence):
1. Forward: cut the sequence into blocks of n tokens (`_BLOCK_TOKENS`); query block j runs against key blocks
   i <= j that hold an allowed pair (same document from `position_ids`, causal, within the sliding window; blocks
   with none are skipped, so a window of w costs O(S·w)), each through `block_forward` — the device's fused op
   for a block inside one document and window with no softcap, else the PyTorch kernel — merged by online
   softmax; then the sinks, once per row, after the merge (`models.attention_sinks.apply_sinks`).
   Saved: q, k, v, the output O' and its lse' (O(S)); no score matrix.
2. Backward: per (j, i) block, FlashAttention's backward with block j's (O', lse') (`block_backward`): dq, dk, dv;
   and the sinks' gradient from the rows (`sink_gradient`).

Memory: O(S·(H + 2·H_kv)·D) saved (as SDPA's flash kernel), score tiles of O(n²) per head in flight. Cost: the
block kernels' FLOPs (causal blocks only), one kernel call per block pair (S²/(2n²) pairs without a window).
Composes with Ulysses (sinks sliced per rank by the wrapper), LoRA, checkpointing (a pure function of q/k/v);
chunked attention (FPDT) does not call it — it merges its own blocks and applies the sinks itself.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch.autograd.function import once_differentiable

from lstune.errors import ModelError
from lstune.memory.attention_blocks import MASKED, allowed_pairs, block_backward, block_forward, block_kinds, merge
from lstune.memory.tiling import tile_bounds
from lstune.models.attention import document_ids
from lstune.models.attention_sinks import apply_sinks, grouped_sinks, rowsums, sink_gradient

if TYPE_CHECKING:
    from torch import Tensor

# Query/key block length: fp32 score tiles of 1M elements per head, and few enough kernel calls.
_BLOCK_TOKENS = 1024


def block_attention(query_BHSD: Tensor, key_BHSD: Tensor, value_BHSD: Tensor, *, position_ids_BS: Tensor,
                    scaling: float | None, sliding_window: int | None, softcap: float | None,
                    sinks: Tensor | None = None, dropout: float = 0.0,
                    block_tokens: int = _BLOCK_TOKENS) -> Tensor:
    """Per-document causal attention (windowed, softcapped, with sinks) of full-sequence q/k/v [B, H, S, D] (k/v
    may have fewer heads, GQA); `position_ids_BS` [B, S] mark the documents. Returns [B, S, H, D] like HF's
    attention functions. `sinks`: one logit per query head ([H]), or None. The kernel
    `models.attention.local_attention` runs for sinks and for softcapping where no backend can."""
    if dropout:
        raise ModelError(f"lstune's block attention (sinks, softcapping on CPU) has no attention dropout (got "
                         f"{dropout}); set attention_dropout=0 in the model config.")
    batch, heads, seq, dim = query_BHSD.shape
    kv_heads = key_BHSD.shape[1]
    if sinks is not None and sinks.shape != (heads,):
        raise ModelError(f"attention sinks of shape {tuple(sinks.shape)} for {heads} query heads; expected [{heads}].")
    scale = scaling if scaling is not None else dim ** -0.5
    index_BS = torch.arange(seq, device=query_BHSD.device).expand(batch, seq)
    doc_BS = document_ids(position_ids_BS.to(query_BHSD.device).expand(batch, seq))
    bounds = tile_bounds(seq, max(1, math.ceil(seq / block_tokens)))
    config = _Config(scale, sliding_window, softcap, kv_heads, bounds, index_BS, doc_BS)
    out5 = _BlockAttention.apply(config, query_BHSD, key_BHSD, value_BHSD, sinks)
    batch, kv, group, seq, value_dim = out5.shape
    return out5.reshape(batch, kv * group, seq, value_dim).transpose(1, 2).contiguous()


class _Config:
    """What the Function needs besides the tensors it differentiates."""

    def __init__(self, scale, window, softcap, kv_heads, bounds, index_BS, doc_BS):
        self.scale, self.window, self.softcap, self.kv_heads = scale, window, softcap, kv_heads
        self.bounds, self.index_BS, self.doc_BS = bounds, index_BS, doc_BS
        self.kinds: dict[int, dict[int, str]] = {}  # query block j -> {key block i: kernel kind}

    def ids(self, block: int) -> tuple[Tensor, Tensor]:
        a, b = self.bounds[block]
        return self.index_BS[:, a:b], self.doc_BS[:, a:b]

    def allowed(self, j: int, i: int) -> Tensor:
        return allowed_pairs(*self.ids(j), *self.ids(i), self.window)


def _to5(x_BHSD: Tensor, kv_heads: int) -> Tensor:
    """[B, H, S, D] → [B, H_kv, H/H_kv, S, D]: query head h uses kv head h // (H/H_kv) (HF's repeat_kv)."""
    batch, heads, seq, dim = x_BHSD.shape
    return x_BHSD.reshape(batch, kv_heads, heads // kv_heads, seq, dim)


class _BlockAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, config: _Config, query: Tensor, key: Tensor, value: Tensor, sinks: Tensor | None) -> Tensor:
        q5 = _to5(query, config.kv_heads)
        outs, lses = [], []
        for j, (a, b) in enumerate(config.bounds):
            ids_q = config.ids(j)
            kinds = block_kinds(q5[:, :, :, a:b], key, value, ids_q, [config.ids(i) for i in range(j + 1)],
                                config.window, config.softcap)
            config.kinds[j] = {i: kind for i, kind in enumerate(kinds) if kind is not None}
            acc_out = acc_lse = None
            for i, kind in config.kinds[j].items():
                c, d = config.bounds[i]
                allowed = config.allowed(j, i) if kind == MASKED else None
                out, lse = block_forward(kind, q5[:, :, :, a:b], key[:, :, c:d], value[:, :, c:d], allowed,
                                         config.scale, config.softcap)
                acc_out, acc_lse = merge(acc_out, acc_lse, out, lse)
            outs.append(acc_out)
            lses.append(acc_lse)
        out5, lse = torch.cat(outs, dim=3), torch.cat(lses, dim=3)
        if sinks is not None:
            out5, lse = apply_sinks(out5, lse, grouped_sinks(sinks, config.kv_heads))
        out5 = out5.to(query.dtype)
        ctx.config = config
        ctx.save_for_backward(query, key, value, sinks, out5, lse)
        return out5

    @staticmethod
    @once_differentiable
    def backward(ctx, dout5: Tensor):
        config: _Config = ctx.config
        query, key, value, sinks, out5, lse = ctx.saved_tensors
        q5 = _to5(query, config.kv_heads)
        dq5 = torch.zeros(q5.shape, dtype=torch.float32, device=q5.device)
        dk = torch.zeros(key.shape, dtype=torch.float32, device=key.device)
        dv = torch.zeros(value.shape, dtype=torch.float32, device=value.device)
        for j, (a, b) in enumerate(config.bounds):
            rows = slice(a, b)
            delta = None
            for i, kind in config.kinds[j].items():
                c, d = config.bounds[i]
                if kind == MASKED:
                    if delta is None:
                        delta = rowsums(out5[:, :, :, rows], dout5[:, :, :, rows])
                    merged, allowed = (delta, lse[..., rows]), config.allowed(j, i)
                else:
                    merged, allowed = (out5[:, :, :, rows], lse[..., rows]), None
                dq, dk_i, dv_i = block_backward(kind, q5[:, :, :, rows], key[:, :, c:d], value[:, :, c:d],
                                                dout5[:, :, :, rows], merged, allowed, config.scale, config.softcap)
                dq5[:, :, :, rows] += dq
                dk[:, :, c:d] += dk_i
                dv[:, :, c:d] += dv_i
        dsinks = None
        if sinks is not None and ctx.needs_input_grad[4]:
            per_row = sink_gradient(lse, rowsums(out5, dout5), grouped_sinks(sinks, config.kv_heads))
            dsinks = per_row.sum(dim=(0, 3)).reshape(sinks.shape).to(sinks.dtype)
        dquery = dq5.reshape(query.shape).to(query.dtype)
        return None, dquery, dk.to(key.dtype), dv.to(value.dtype), dsinks
