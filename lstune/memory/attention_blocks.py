"""The block kernels of chunked attention (`attention_chunks`): one (query chunk, key chunk) block's forward, which
returns (output, log-sum-exp) for the online-softmax merge, and its backward, FlashAttention's with the query
chunk's *merged* output and lse (P = exp(S - lse), delta = rowsum(dO ∘ o)) — exactly the gradient of the merge.

Two kernels, and `block_kinds` is the one place that picks between them:
- A device's fused attention ops (`FLASH_OPS`, in order of preference: on CUDA cuDNN's
  `_scaled_dot_product_cudnn_attention`, then PyTorch's flash `_scaled_dot_product_flash_attention`; on CPU
  `_scaled_dot_product_flash_attention_for_cpu`; each with its backward), which return the lse and take (out, lse),
  recomputing delta from `out`, for a block inside one document and one sliding window, with no softcap: off-diagonal
  blocks (every key before every query) run non-causal ("full"), diagonal blocks (the same tokens on both sides)
  causal ("causal"). Queries [B, H, t, D], keys/values [B, H_kv, s, D] (native GQA on CPU; expanded per block,
  O(chunk), on CUDA), lse [B, H, t] fp32; in autocast's dtype under autocast, as SDPA. cuDNN comes first on CUDA
  because it is what SDPA runs there: on an H200 (2026-11-26) PyTorch's flash op made 4-chunk attention 1.54 × the
  unchunked step at 128K, at about half of cuDNN's measured rate.
- The pure-PyTorch kernel ("masked") for everything else — blocks cut by a document start, a window or causality
  not on the diagonal, softcapping, dtypes/head dims the op lacks, and fake tensors (memory traces, which have no
  values to decide from): fp32 scores masked by `allowed_pairs`, query rows sub-tiled to bound the score tile.
Both give the same (out, lse) and (dq, dk, dv) up to rounding (tests/unit/memory/test_attention_blocks.py).

Safety: a device's ops are used for a (device, dtype, head dim) only after a one-time probe (`flash_ops`) ran a small
random two-block merge forward and backward through both kernels and found them equal within the dtype's rounding;
ops that raise or differ are logged once and the next in the list used, in the end the PyTorch kernel — a model is
exact or refused, never silently wrong. Ops that pass the probe but raise on a real block (a shape they refuse) are
dropped for the rest of the run and the block re-run by the next. This is what guards the CUDA ops, whose signatures
were wired from their schemas without a GPU at hand.
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
    """`block_kinds` of one key block that has an allowed pair (MASKED where it has none)."""
    return block_kinds(q5, k4, v4, ids_q, [ids_k], window, softcap)[0] or MASKED


def block_kinds(q5: Tensor, k4: Tensor, v4: Tensor, ids_q: tuple[Tensor, Tensor],
                ids_ks: list[tuple[Tensor, Tensor]], window: int | None, softcap: float | None) -> list[str | None]:
    """For query rows q5 against each key block (the rows' own tokens, or tokens all before them), from the blocks'
    (global token index, document key) ids [B, n]: FULL or CAUSAL (the flash kernel, non-causal / causal), MASKED
    (the PyTorch kernel), or None where no pair is allowed (`allowed_pairs`; the block is skipped). `k4`/`v4` of any
    of the blocks (dtypes and head dims). One device sync for all the blocks; none for fake tensors (memory traces:
    no values, so every block runs the PyTorch kernel)."""
    from torch._subclasses.fake_tensor import is_fake

    if is_fake(q5):
        return [MASKED] * len(ids_ks)
    dtype = _compute_dtype(q5, k4, v4)
    fused = softcap is None and dtype is not None and _flash_shapes(q5, k4, v4, dtype)
    flags = torch.stack([_block_flags(*ids_q, *ids_k, window) for ids_k in ids_ks]).tolist()
    kinds: list[str | None] = []
    for attended, one_span, before, same in flags:
        kind = FULL if one_span and before else CAUSAL if one_span and same else MASKED
        kinds.append(None if not (attended or same) else kind if fused else MASKED)
    if any(kind in (FULL, CAUSAL) for kind in kinds) and flash_ops(q5.device, dtype, q5.shape[-1]) is None:
        return [kind and MASKED for kind in kinds]
    return kinds


def _block_flags(index_q: Tensor, doc_q: Tensor, index_k: Tensor, doc_k: Tensor, window: int | None) -> Tensor:
    """Bool [4] of one block: (a pair allowed with keys before the queries, one document and window span both,
    every key before every query, the same tokens). The first from the blocks' edges: token indices ascend within a
    block and every document is one run of tokens (its key, index − position, the same throughout; chunked
    attention's `_PositionOrder` refuses position_ids where that fails), so with every key before every query the
    only document both hold is the one spanning the gap — the last key's and the first query's — and its closest
    pair is those two tokens."""
    doc = doc_q[:, :1]
    one_span = (doc_q == doc).all() & (doc_k == doc).all()
    edge = doc_k[:, -1] == doc_q[:, 0]
    if window is not None:
        one_span &= (index_q.amax(1) - index_k.amin(1) < window).all()
        edge &= index_q[:, 0] - index_k[:, -1] < window
    before = (index_k.amax(1) < index_q.amin(1)).all()
    same = (index_q == index_k).all() if index_q.shape == index_k.shape else torch.zeros_like(before)
    return torch.stack([edge.any() & before, one_span, before, same])


def _compute_dtype(q5: Tensor, k4: Tensor, v4: Tensor) -> torch.dtype | None:
    """The dtype a flash block runs in: autocast's where it is on (as SDPA under autocast: with fp32 weights, rotary
    leaves q and k fp32 while v is 16-bit), else q/k/v's common dtype (None if they differ)."""
    device = q5.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return q5.dtype if q5.dtype == k4.dtype == v4.dtype else None


def _flash_shapes(q5: Tensor, k4: Tensor, v4: Tensor, dtype: torch.dtype) -> bool:
    """Dtypes and shapes one of the device's fused ops takes: one head dim for q, k and v."""
    ops = FLASH_OPS.get(q5.device.type, ())
    return any(dtype in o.dtypes for o in ops) and q5.shape[-1] == k4.shape[-1] == v4.shape[-1]


def block_forward(kind: str, q5: Tensor, k4: Tensor, v4: Tensor, allowed: Tensor | None, scale: float,
                  softcap: float | None) -> tuple[Tensor, Tensor]:
    """Rows q5 [B, Hkv, g, t, D] against one key block k4/v4 [B, Hkv, s, D]: (fp32 output [B, Hkv, g, t, D], lse
    [B, Hkv, g, t]; -inf on rows with no allowed key). `allowed` (`allowed_pairs`) only for MASKED blocks."""
    if kind == MASKED:
        return _torch_forward(q5, k4, v4, allowed, scale, softcap)
    return _with_fallback(_flash_forward, q5, k4, v4, kind == CAUSAL, scale)


def block_backward(kind: str, q5: Tensor, k4: Tensor, v4: Tensor, dout5: Tensor, merged: tuple[Tensor, Tensor],
                   allowed: Tensor | None, scale: float, softcap: float | None) -> tuple[Tensor, Tensor, Tensor]:
    """The block's FlashAttention backward with the query rows' merged lse and `merged` = (o, lse) for flash blocks,
    (delta = rowsum(dO ∘ o), lse) for MASKED ones: (dq fp32 [B, Hkv, g, t, D], dk, dv fp32 [B, Hkv, s, D])."""
    if kind == MASKED:
        delta, lse = merged
        return _torch_backward(q5, k4, v4, dout5, lse, delta, allowed, scale, softcap)
    out5, lse = merged
    return _with_fallback(_flash_backward, q5, k4, v4, dout5, out5, lse, kind == CAUSAL, scale)


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
# The fused kernels: cuDNN's and PyTorch's flash-attention ops
# --------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FlashOps:
    """One device type's fused attention ops on [B, H, n, D] tensors, no dropout.
    forward(q, k, v, causal, scale) -> (out, lse [B, H, t] fp32);
    backward(dout, q, k, v, out, lse, causal, scale) -> (dq, dk, dv), delta recomputed from `out`."""

    name: str
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


# The lse layout cuDNN's forward returned ([B, H, t] in older torch, [B, H, t, 1] in newer): its backward takes the
# same. Set by the first forward; the probe always runs one before any backward.
_CUDNN_LSE_DIMS: dict[str, int] = {}


def _cudnn_forward(q, k, v, causal, scale):
    out, lse, *_ = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False,
                                                                       scale=scale)
    _CUDNN_LSE_DIMS["lse"] = lse.dim()
    return out, lse.reshape(q.shape[:3])


def _cudnn_backward(dout, q, k, v, out, lse, causal, scale):
    # No bias, no nested tensors, no dropout (seed and offset unread; 0-dim int64 on the device, as the forward
    # makes them).
    lse = lse.reshape(*lse.shape, *[1] * (_CUDNN_LSE_DIMS.get("lse", 3) - 3))
    seed = torch.zeros((), dtype=torch.int64, device=q.device)
    return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        dout, q, k, v, out, lse, seed, seed, None, None, None, q.shape[2], k.shape[2], 0.0, causal, scale=scale)


_HALF = (torch.bfloat16, torch.float16)
# Per device type, in order of preference (module doc: why cuDNN first on CUDA).
FLASH_OPS: dict[str, tuple[FlashOps, ...]] = {
    "cpu": (FlashOps("flash", _cpu_forward, _cpu_backward, (torch.float32, torch.float64, *_HALF), True),),
    "cuda": (FlashOps("cuDNN", _cudnn_forward, _cudnn_backward, _HALF, False),
             FlashOps("flash", _cuda_forward, _cuda_backward, _HALF, False)),
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


def flash_ops(device: torch.device, dtype: torch.dtype, head_dim: int) -> FlashOps | None:
    """The device's first fused ops that agree with the PyTorch kernel for this dtype and head dim (each probed
    once), or None: the PyTorch kernel."""
    for ops in FLASH_OPS.get(device.type, ()):
        if dtype in ops.dtypes and _usable(ops, device, dtype, head_dim):
            return ops
    return None


def flash_usable(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    return flash_ops(device, dtype, head_dim) is not None


def _usable(ops: FlashOps, device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    key = (str(device), dtype, head_dim, ops)
    if key not in _PROBED:
        _PROBED[key] = _probe(ops, device, dtype, head_dim)
    return _PROBED[key]


def _with_fallback(run: Callable, q5: Tensor, *args):
    """`run` (_flash_forward or _flash_backward) with the first usable ops; ops that raise on this block (a shape
    they refuse, not running out of memory) are dropped for the run, with a warning, and the next ops take it — the
    probe found every ops in the list equal to the PyTorch kernel, so blocks may mix them."""
    device, dtype, head_dim = q5.device, _compute_dtype(q5, *args[:2]), q5.shape[-1]
    failed: RuntimeError | None = None
    while (ops := flash_ops(device, dtype, head_dim)) is not None:
        try:
            return run(ops, q5, *args)
        except torch.OutOfMemoryError:
            raise
        except RuntimeError as failure:
            failed = failure
            logger.warning("chunked attention: %s's %s attention op failed on a %s block of %s (%s); using the next "
                           "op if there is one, for the rest of the run.", device, ops.name, dtype, tuple(q5.shape), failure)
            _PROBED[(str(device), dtype, head_dim, ops)] = False
    raise failed or RuntimeError(f"chunked attention: no attention op left for {dtype} blocks on {device}")


def _probe(ops: FlashOps, device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    try:
        with torch.no_grad(), torch.autocast(device.type, enabled=False):
            error = _probe_error(ops, device, dtype, head_dim)
    except Exception as failure:  # noqa: BLE001 — any refusal of the op means: use the next kernel
        logger.warning("chunked attention: %s's %s attention ops failed on a %s block with head dim %d (%s); "
                       "using %s there.", device, ops.name, dtype, head_dim, failure, _next_kernel(ops, device))
        return False
    if error > _PROBE_TOLERANCE[dtype]:
        logger.warning("chunked attention: %s's %s attention ops differ from the PyTorch block kernel on a %s block "
                       "with head dim %d (relative error %.1e); using %s there.",
                       device, ops.name, dtype, head_dim, error, _next_kernel(ops, device))
        return False
    return True


def _next_kernel(ops: FlashOps, device: torch.device) -> str:
    rest = FLASH_OPS.get(device.type, ())
    rest = rest[rest.index(ops) + 1:] if ops in rest else ()
    return f"the {rest[0].name} ops if they pass" if rest else "the PyTorch block kernel (exact, slower)"


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
        dprobs = torch.matmul(dout_t, v4[:, :, None].transpose(-1, -2).to(dout_t.dtype)).float()
        dscores = probs * (dprobs - delta[..., a:b, None])
        if capped is not None:
            dscores = dscores * (1 - capped * capped)
        dscores = dscores * scale
        dqs.append(torch.matmul(dscores.to(k4.dtype), k4[:, :, None]).float())
        dk = dk + torch.matmul(dscores.transpose(-1, -2).to(q_t.dtype), q_t).float().sum(2)
    return torch.cat(dqs, dim=3), dk, dv


# --------------------------------------------------------------------------------------------------------------------
# Whole spans with the fused ops: saved attention (lstune.memory.attention_saved)
# --------------------------------------------------------------------------------------------------------------------


def span_dtype(q4: Tensor, k4: Tensor, v4: Tensor) -> torch.dtype | None:
    """The dtype a span runs in (`_compute_dtype`: autocast's, else q/k/v's common one; None if they differ)."""
    return _compute_dtype(q4, k4, v4)


def span_forward(ops: FlashOps, q4: Tensor, k4: Tensor, v4: Tensor, causal: bool, scale: float,
                 dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """q4 [B, H, t, D] against k4/v4 [B, H_kv, t, D] with `ops` in `dtype`: (out [B, H, t, D] in `dtype`, lse
    [B, H, t] fp32). Unlike the blocks' kernels the output is not upcast: a span is a whole document, not a partial
    result to merge."""
    group = q4.shape[1] // k4.shape[1]
    out4, lse = ops.forward(q4.to(dtype), _heads(ops, k4.to(dtype), group), _heads(ops, v4.to(dtype), group),
                            causal, scale)
    return out4, lse.float().reshape(q4.shape[:3])


def span_backward(ops: FlashOps, dout4: Tensor, q4: Tensor, k4: Tensor, v4: Tensor, out4: Tensor, lse: Tensor,
                  causal: bool, scale: float, dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    """`span_forward`'s backward from its saved (out, lse): (dq [B, H, t, D], dk, dv [B, H_kv, t, D]) in `dtype`
    (fp32 sums over each kv head's query heads where the ops take no GQA)."""
    batch, heads, t, _ = q4.shape
    kv_heads = k4.shape[1]
    group = heads // kv_heads
    lse3 = lse.to(torch.promote_types(dtype, torch.float32)).contiguous()
    dq, dk, dv = ops.backward(dout4.to(dtype), q4.to(dtype), _heads(ops, k4.to(dtype), group),
                              _heads(ops, v4.to(dtype), group), out4.to(dtype), lse3, causal, scale)
    if dk.shape[1] != kv_heads:
        dk, dv = (x.float().reshape(batch, kv_heads, group, *x.shape[2:]).sum(2).to(dtype) for x in (dk, dv))
    return dq, dk, dv


def span_call(run: Callable, device: torch.device, dtype: torch.dtype, head_dim: int, *args):
    """`run(ops, *args)` (`span_forward` / `span_backward`) with the device's first usable ops for `dtype`; ops that
    raise on this span (a shape they refuse, not running out of memory) are dropped for the run and the next ops take
    it, as `_with_fallback` does for blocks (the probe found each equal to the PyTorch kernel, so a backward may run on
    other ops than its forward)."""
    failed: RuntimeError | None = None
    while (ops := flash_ops(device, dtype, head_dim)) is not None:
        try:
            return run(ops, *args)
        except torch.OutOfMemoryError:
            raise
        except RuntimeError as failure:
            failed = failure
            logger.warning("saved attention: %s's %s attention op failed on a %s span of %s (%s); using the next op "
                           "if there is one, for the rest of the run.", device, ops.name, dtype, tuple(args[0].shape),
                           failure)
            _PROBED[(str(device), dtype, head_dim, ops)] = False
    raise failed or RuntimeError(f"saved attention: no attention op left for {dtype} spans on {device}")
