"""The block kernels of chunked attention (`attention_chunks`): one (query chunk, key chunk) block's forward, which
returns (output, log-sum-exp) for the online-softmax merge, and its backward, FlashAttention's with the query
chunk's *merged* output and lse (P = exp(S - lse), delta = rowsum(dO ∘ o)) — exactly the gradient of the merge.

Two kernels, and `block_kind` is the one place that picks between them:
- PyTorch's flash-attention ops (`FLASH_OPS`: `_scaled_dot_product_flash_attention[_for_cpu]` and their backwards,
  which return the lse and take (out, lse), recomputing delta from `out`), for a block inside one document and one
  sliding window, with no softcap: off-diagonal blocks (every key before every query) run non-causal ("full"),
  diagonal blocks (the same tokens on both sides) causal ("causal"). Queries [B, H, t, D], keys/values
  [B, H_kv, s, D] (native GQA on CPU; expanded per block, O(chunk), on CUDA), lse [B, H, t] fp32; in autocast's
  dtype under autocast, as SDPA.
- The pure-PyTorch kernel ("masked") for everything else — blocks cut by a document start, a window or causality
  not on the diagonal, softcapping, dtypes/head dims the op lacks, and fake tensors (memory traces, which have no
  values to decide from): fp32 scores masked by `allowed_pairs`, query rows sub-tiled to bound the score tile.
Both give the same (out, lse) and (dq, dk, dv) up to rounding (tests/unit/memory/test_attention_blocks.py).

Safety: a device's flash ops are used for a (device, dtype, head dim) only after a one-time probe (`flash_usable`)
ran a small random two-block merge forward and backward through both kernels and found them equal within the dtype's
rounding; an op that raises or differs is logged once and the PyTorch kernel used instead — a model is exact or
refused, never silently wrong. This is what guards the CUDA ops, whose signatures were wired from their schemas
without a GPU at hand.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch

from lstune.memory.tiling import tile_bounds

if TYPE_CHECKING:
    from torch import Tensor

logger = logging.getLogger("lstune")

# Score tiles of the PyTorch kernel hold at most this many fp32 elements (256 MiB), whatever the chunk size.
_SCORE_ELEMENTS = 1 << 26
FULL, CAUSAL, MASKED = "full", "causal", "masked"


# --------------------------------------------------------------------------------------------------------------------
# Which kernel a block takes
# --------------------------------------------------------------------------------------------------------------------


def block_kind(q5: Tensor, k4: Tensor, v4: Tensor, ids_q: tuple[Tensor, Tensor], ids_k: tuple[Tensor, Tensor],
               window: int | None, softcap: float | None) -> str:
    """FULL, CAUSAL (flash kernel, non-causal / causal) or MASKED (PyTorch kernel) for query rows q5 against one key
    block, from the blocks' (global token index, document key) ids [B, n]; syncs the device once."""
    from torch._subclasses.fake_tensor import is_fake

    dtype = _compute_dtype(q5, k4, v4)
    if softcap is not None or is_fake(q5) or dtype is None or not _flash_shapes(q5, k4, v4, dtype):
        return MASKED
    (index_q, doc_q), (index_k, doc_k) = ids_q, ids_k
    doc = doc_q[:, :1]
    one_span = (doc_q == doc).all() & (doc_k == doc).all()
    if window is not None:
        one_span &= (index_q.amax(1) - index_k.amin(1) < window).all()
    before = (index_k.amax(1) < index_q.amin(1)).all()
    same = (index_q == index_k).all() if index_q.shape == index_k.shape else torch.zeros_like(before)
    one_span, before, same = torch.stack([one_span, before, same]).tolist()
    kind = FULL if one_span and before else CAUSAL if one_span and same else MASKED
    if kind != MASKED and not flash_usable(q5.device, dtype, q5.shape[-1]):
        return MASKED
    return kind


def _compute_dtype(q5: Tensor, k4: Tensor, v4: Tensor) -> torch.dtype | None:
    """The dtype a flash block runs in: autocast's where it is on (as SDPA under autocast: with fp32 weights, rotary
    leaves q and k fp32 while v is 16-bit), else q/k/v's common dtype (None if they differ)."""
    device = q5.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return q5.dtype if q5.dtype == k4.dtype == v4.dtype else None


def _flash_shapes(q5: Tensor, k4: Tensor, v4: Tensor, dtype: torch.dtype) -> bool:
    """Dtypes and shapes the device's flash ops take: one head dim for q, k and v."""
    ops = FLASH_OPS.get(q5.device.type)
    return ops is not None and dtype in ops.dtypes and q5.shape[-1] == k4.shape[-1] == v4.shape[-1]


def block_forward(kind: str, q5: Tensor, k4: Tensor, v4: Tensor, allowed: Tensor | None, scale: float,
                  softcap: float | None) -> tuple[Tensor, Tensor]:
    """Rows q5 [B, Hkv, g, t, D] against one key block k4/v4 [B, Hkv, s, D]: (fp32 output [B, Hkv, g, t, D], lse
    [B, Hkv, g, t]; -inf on rows with no allowed key). `allowed` (`allowed_pairs`) only for MASKED blocks."""
    if kind == MASKED:
        return _torch_forward(q5, k4, v4, allowed, scale, softcap)
    return _flash_forward(FLASH_OPS[q5.device.type], q5, k4, v4, kind == CAUSAL, scale)


def block_backward(kind: str, q5: Tensor, k4: Tensor, v4: Tensor, dout5: Tensor, merged: tuple[Tensor, Tensor],
                   allowed: Tensor | None, scale: float, softcap: float | None) -> tuple[Tensor, Tensor, Tensor]:
    """The block's FlashAttention backward with the query rows' merged lse and `merged` = (o, lse) for flash blocks,
    (delta = rowsum(dO ∘ o), lse) for MASKED ones: (dq fp32 [B, Hkv, g, t, D], dk, dv fp32 [B, Hkv, s, D])."""
    if kind == MASKED:
        delta, lse = merged
        return _torch_backward(q5, k4, v4, dout5, lse, delta, allowed, scale, softcap)
    out5, lse = merged
    return _flash_backward(FLASH_OPS[q5.device.type], q5, k4, v4, dout5, out5, lse, kind == CAUSAL, scale)


def allowed_pairs(index_q: Tensor, doc_q: Tensor, index_k: Tensor, doc_k: Tensor, window: int | None) -> Tensor:
    """Bool [B, 1, 1, t, s]: same document, key not after query, within the window."""
    q, k = index_q[:, :, None], index_k[:, None, :]
    allowed = (doc_q[:, :, None] == doc_k[:, None, :]) & (k <= q)
    if window is not None:
        allowed &= q - k < window
    return allowed[:, None, None]


def merge(acc_out, acc_lse, out, lse):
    """Online softmax: combine two partial results over disjoint key sets (rows with lse -inf contribute 0)."""
    if acc_out is None:
        return out, lse
    total = torch.logaddexp(acc_lse, lse)
    safe = _finite(total)
    w_acc = torch.where(torch.isneginf(acc_lse), 0.0, torch.exp(acc_lse - safe))
    w_new = torch.where(torch.isneginf(lse), 0.0, torch.exp(lse - safe))
    return acc_out * w_acc[..., None] + out * w_new[..., None], total


# --------------------------------------------------------------------------------------------------------------------
# The flash kernel: PyTorch's flash-attention ops
# --------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FlashOps:
    """One device type's flash-attention ops on [B, H, n, D] tensors, no dropout.
    forward(q, k, v, causal, scale) -> (out, lse [B, H, t] fp32);
    backward(dout, q, k, v, out, lse, causal, scale) -> (dq, dk, dv), delta recomputed from `out`."""

    forward: Callable
    backward: Callable
    dtypes: tuple[torch.dtype, ...]
    gqa: bool  # takes fewer k/v heads than q heads (else k/v are expanded per block)


def _cpu_forward(q, k, v, causal, scale):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)


def _cpu_backward(dout, q, k, v, out, lse, causal, scale):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(dout, q, k, v, out, lse, 0.0, causal,
                                                                                scale=scale)


def _cuda_forward(q, k, v, causal, scale):
    out, lse, *_ = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
    return out, lse


def _cuda_backward(dout, q, k, v, out, lse, causal, scale):
    # No nested tensors (cum_seq None, max lengths the block's) and no dropout (the philox state is not read; shaped
    # as the forward returns it).
    seed, offset = torch.zeros(2, dtype=torch.uint64), torch.zeros((), dtype=torch.uint64)
    return torch.ops.aten._scaled_dot_product_flash_attention_backward(
        dout, q, k, v, out, lse, None, None, q.shape[2], k.shape[2], 0.0, causal, seed, offset, scale=scale)


FLASH_OPS: dict[str, FlashOps] = {
    "cpu": FlashOps(_cpu_forward, _cpu_backward, (torch.float32, torch.float64, torch.bfloat16, torch.float16), True),
    "cuda": FlashOps(_cuda_forward, _cuda_backward, (torch.bfloat16, torch.float16), False),
}


def _heads(ops: FlashOps, x4: Tensor, group: int) -> Tensor:
    """k/v [B, Hkv, s, D] as the op takes them: as they are, or each kv head repeated for its `group` query heads."""
    if ops.gqa or group == 1:
        return x4
    batch, kv_heads, s, dim = x4.shape
    return x4[:, :, None].expand(batch, kv_heads, group, s, dim).reshape(batch, kv_heads * group, s, dim)


def _flash_forward(ops: FlashOps, q5, k4, v4, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    batch, kv_heads, group, t, dim = q5.shape
    dtype = _compute_dtype(q5, k4, v4)
    q4 = q5.to(dtype).reshape(batch, kv_heads * group, t, dim)
    k4, v4 = _heads(ops, k4.to(dtype), group), _heads(ops, v4.to(dtype), group)
    out4, lse = ops.forward(q4, k4, v4, causal, scale)
    return out4.float().reshape(q5.shape), lse.float().reshape(batch, kv_heads, group, t)


def _flash_backward(ops: FlashOps, q5, k4, v4, dout5, out5, lse, causal: bool, scale: float):
    batch, kv_heads, group, t, dim = q5.shape
    heads, dtype = kv_heads * group, _compute_dtype(q5, k4, v4)
    q4, dout4, out4 = (x.to(dtype).reshape(batch, heads, t, dim) for x in (q5, dout5, out5))
    k4, v4 = _heads(ops, k4.to(dtype), group), _heads(ops, v4.to(dtype), group)
    # The ops' lse is in their accumulation type: fp32, fp64 for fp64 inputs.
    lse3 = lse.to(torch.promote_types(dtype, torch.float32)).reshape(batch, heads, t).contiguous()
    dq, dk, dv = ops.backward(dout4, q4, k4, v4, out4, lse3, causal, scale)
    if dk.shape[1] != kv_heads:
        dk, dv = (x.float().reshape(batch, kv_heads, group, *x.shape[2:]).sum(2) for x in (dk, dv))
    return dq.float().reshape(q5.shape), dk.float(), dv.float()


# --------------------------------------------------------------------------------------------------------------------
# The probe: a device's flash ops are used only once they agree with the PyTorch kernel
# --------------------------------------------------------------------------------------------------------------------

_PROBED: dict[tuple, bool] = {}
# Relative (norm) difference allowed between the two kernels on the probe's block: a few units of the dtype's rounding
# (of fp32 for fp64, whose PyTorch-kernel scores are fp32).
# A wrong layout, mask or lse is off by O(1).
_PROBE_TOLERANCE = {torch.float64: 1e-4, torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 5e-3}


def flash_usable(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether the device's flash ops agree with the PyTorch kernel for this dtype and head dim (probed once)."""
    ops = FLASH_OPS.get(device.type)
    if ops is None or dtype not in ops.dtypes:
        return False
    key = (str(device), dtype, head_dim, ops)
    if key not in _PROBED:
        _PROBED[key] = _probe(ops, device, dtype, head_dim)
    return _PROBED[key]


def _probe(ops: FlashOps, device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    try:
        with torch.no_grad(), torch.autocast(device.type, enabled=False):
            error = _probe_error(ops, device, dtype, head_dim)
    except Exception as failure:  # noqa: BLE001 — any refusal of the op means: use the PyTorch kernel
        logger.warning("chunked attention: %s's flash-attention ops failed on a %s block with head dim %d (%s); "
                       "using the PyTorch block kernel there (exact, slower).", device, dtype, head_dim, failure)
        return False
    if error > _PROBE_TOLERANCE[dtype]:
        logger.warning("chunked attention: %s's flash-attention ops differ from the PyTorch block kernel on a %s block "
                       "with head dim %d (relative error %.1e); using the PyTorch kernel there (exact, slower).",
                       device, dtype, head_dim, error)
        return False
    return True


def _probe_error(ops: FlashOps, device: torch.device, dtype: torch.dtype, head_dim: int) -> float:
    """Largest relative difference between the kernels on a GQA query block merged over an earlier key block
    (non-causal) and its own (causal): forward (out, lse), then each block's backward with the merged out/lse."""
    generator = torch.Generator().manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=generator).to(device, dtype)

    q5, t, s = rand(1, 2, 2, 48, head_dim), 48, 32
    blocks = [(FULL, rand(1, 2, s, head_dim), rand(1, 2, s, head_dim)),
              (CAUSAL, rand(1, 2, t, head_dim), rand(1, 2, t, head_dim))]
    index_q = torch.arange(s, s + t, device=device)[None]
    masks = [allowed_pairs(index_q, index_q * 0, index_k, index_k * 0, None)
             for index_k in (torch.arange(s, device=device)[None], index_q)]
    scale, errors, merged = head_dim ** -0.5, [], {}
    for name, run in (("flash", lambda kind, k4, v4, mask: _flash_forward(ops, q5, k4, v4, kind == CAUSAL, scale)),
                      ("torch", lambda kind, k4, v4, mask: _torch_forward(q5, k4, v4, mask, scale, None))):
        acc = (None, None)
        for (kind, k4, v4), mask in zip(blocks, masks):
            acc = merge(*acc, *run(kind, k4, v4, mask))
        merged[name] = acc
    errors += [_relative(merged["flash"][i], merged["torch"][i]) for i in (0, 1)]
    out5, lse = merged["torch"][0].to(dtype), merged["torch"][1]
    dout5 = rand(*q5.shape)
    delta = (dout5.float() * out5.float()).sum(-1)
    for (kind, k4, v4), mask in zip(blocks, masks):
        fast = _flash_backward(ops, q5, k4, v4, dout5, out5, lse, kind == CAUSAL, scale)
        exact = _torch_backward(q5, k4, v4, dout5, lse, delta, mask, scale, None)
        errors += [_relative(a, b) for a, b in zip(fast, exact)]
    return max(errors)


def _relative(value: Tensor, reference: Tensor) -> float:
    if value.shape != reference.shape:
        raise ValueError(f"shape {tuple(value.shape)}, expected {tuple(reference.shape)}")
    value, reference = value.double(), reference.double()
    return float((value - reference).norm() / reference.norm().clamp_min(1e-30))


# --------------------------------------------------------------------------------------------------------------------
# The PyTorch kernel: fp32 scores, query rows sub-tiled
# --------------------------------------------------------------------------------------------------------------------


def _row_tiles(q5: Tensor, keys: int) -> list[tuple[int, int]]:
    batch, kv_heads, group, n, _ = q5.shape
    rows = max(1, _SCORE_ELEMENTS // max(1, batch * kv_heads * group * keys))
    return tile_bounds(n, -(-n // rows))


def _scores(q5: Tensor, k4: Tensor, allowed: Tensor, scale: float, softcap: float | None):
    """Masked (softcapped) fp32 scores of q rows against keys, and tanh of the capped logits (for backward)."""
    logits = torch.matmul(q5, k4[:, :, None].transpose(-1, -2)).float() * scale
    capped = None
    if softcap is not None:
        capped = torch.tanh(logits / softcap)
        logits = softcap * capped
    return logits.masked_fill(~allowed, float("-inf")), capped


def _finite(lse: Tensor) -> Tensor:
    return torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)


def _torch_forward(q5, k4, v4, allowed, scale, softcap) -> tuple[Tensor, Tensor]:
    outs, lses = [], []
    for a, b in _row_tiles(q5, k4.shape[2]):
        scores, _ = _scores(q5[:, :, :, a:b], k4, allowed[..., a:b, :], scale, softcap)
        lse = torch.logsumexp(scores, dim=-1)
        probs = torch.exp(scores - _finite(lse)[..., None])
        outs.append(torch.matmul(probs.to(v4.dtype), v4[:, :, None]).float())
        lses.append(lse)
    return torch.cat(outs, dim=3), torch.cat(lses, dim=3)


def _torch_backward(q5, k4, v4, dout5, lse, delta, allowed, scale, softcap) -> tuple[Tensor, Tensor, Tensor]:
    dqs, dk, dv = [], 0, 0
    for a, b in _row_tiles(q5, k4.shape[2]):
        q_t, dout_t = q5[:, :, :, a:b], dout5[:, :, :, a:b]
        scores, capped = _scores(q_t, k4, allowed[..., a:b, :], scale, softcap)
        probs = torch.exp(scores - _finite(lse[..., a:b])[..., None])
        dv = dv + torch.matmul(probs.transpose(-1, -2).to(dout_t.dtype), dout_t).float().sum(2)
        dprobs = torch.matmul(dout_t, v4[:, :, None].transpose(-1, -2)).float()
        dscores = probs * (dprobs - delta[..., a:b, None])
        if capped is not None:
            dscores = dscores * (1 - capped * capped)
        dscores = dscores * scale
        dqs.append(torch.matmul(dscores.to(k4.dtype), k4[:, :, None]).float())
        dk = dk + torch.matmul(dscores.transpose(-1, -2).to(q_t.dtype), q_t).float().sum(2)
    return torch.cat(dqs, dim=3), dk, dv
