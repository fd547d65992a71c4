"""lstune's attention backend: per-document causal attention with no attention mask, for any HF causal LM.

Why (ALST Sec. 3.4): transformers builds a `[bs, 1, seq, seq]` mask for eager/SDPA attention and, for
packed batches, for every backend but FlashAttention. At 125K tokens that mask is 29 GiB in bf16 and it grows with
seq². lstune never lets HF build it: causality comes from `is_causal`, packed-document boundaries from `position_ids`
(a position that does not continue its predecessor by +1, i.e. a reset to 0, starts a new document; the rule
transformers' own `find_packed_sequence_indices` uses). What the mask was for is done inside the kernel call:

* ``flash_attention_2`` — `flash_attn_varlen_func` over the flattened batch with `cu_seqlens` from `position_ids`
  (CUDA, fp16/bf16, flash-attn installed). Sliding windows and softcapping are kernel arguments.
* ``sdpa`` — `torch.nn.functional.scaled_dot_product_attention` with `is_causal=True` on each document span (one call
  when every row is one document: PyTorch's flash kernel on CUDA and on CPU). A sliding window shorter than a
  document is run as query blocks against only the keys in reach, with a small banded mask per block.
  Cannot softcap logits: softcapped calls run lstune's block kernel instead (`local_attention`), as do calls with
  learned attention sinks on every backend (`attention_sinks`).
* ``flex`` — `flex_attention` with a document-causal (and windowed) `BlockMask` and a softcap `score_mod`; compiled on
  CUDA. PyTorch has no flex backward on CPU, so on CPU it only runs without gradients.

``auto`` takes flash_attention_2 where it can run, else flex when logits must be softcapped on CUDA, else sdpa.

Memory: the attention path allocates O(B·S) index tensors and the kernels' own O(B·S·H·D) buffers; no O(S²) tensor
(per-block band masks of the windowed sdpa path are O(block·(block+window))). Removed versus HF eager/SDPA with a
packed batch: B·S² mask elements (2 bytes each for a bf16 additive mask). Cost: the sdpa path issues one kernel
call per document (plus one per window block), so batches packed with thousands of tiny documents are launch-bound
on GPU — use flash_attention_2 or flex there.

int32 bound: kernels that compute element offsets in 32 bits fail once an offset reaches 2³¹. q/k/v arrive from HF
as `[B, S, H, D]` storage viewed `[B, H, S, D]`, so a token's offset is s·H·D — the `seq·hidden ≥ 2³¹` bound
(S = 524,288 at hidden 4096). FlashAttention-2 (and PyTorch's SDPA flash kernel, built from it) index with int64;
Triton flex kernels have had int32 K/V offset bugs (pytorch/pytorch#190857), so the flex path makes q/k/v contiguous
per head (offset s·D) when s·H·D would pass 2³¹. `cu_seqlens` is int32 as flash-attn requires: B·S < 2³¹ tokens.
The attention output itself is a `[B, S, H·D]` tensor, unavoidably.

Composes with: Ulysses sequence parallelism (which calls `local_attention` on head-sharded, full-sequence q/k/v with
the full `position_ids`), LoRA, tiled MLP/loss, activation checkpointing and offload (pure function of q/k/v).

HF hooks (one place, nothing at import time, all undone by `AttentionHandle.undo`): an attention function under a
fresh key in `AttentionInterface` and a mask function under the same key in `AttentionMaskInterface` that returns
None, then `model.set_attn_implementation(key)`. transformers 5.23 `masking_utils` only calls the mask function of a
key present in `AttentionMaskInterface._global_mapping` — absent, it silently drops 2D padding masks — so lstune
registers one that builds nothing and refuses what it cannot honour (padding masks, custom mask overlays).
`position_ids` reaches attention functions through the decoder layers' `**kwargs`.
"""

from __future__ import annotations

import functools
import itertools
import logging
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch
import torch.nn.functional as F

from lstune.errors import ModelError, UserError
from lstune.models import hf_internals
from lstune.models.attention_backends import (  # noqa: F401  (re-exported: torch-free, for the run plan)
    _BIDIRECTIONAL_MESSAGE, BACKENDS, _bidirectional_problem, _check_backend_name, _flash_attn_importable,
    _flex_importable, available_backends, check_attention_support, resolve_backend)

if TYPE_CHECKING:
    from torch import Tensor
    from torch.nn.attention.flex_attention import BlockMask
    from transformers import PreTrainedModel

logger = logging.getLogger("lstune")

_INT32_LIMIT = 2**31
# The windowed sdpa path runs query blocks of max(window, this) tokens: fewer kernel calls for tiny windows, at most
# 2x the banded FLOPs for large ones.
_MIN_WINDOW_BLOCK = 256
_registration_ids = itertools.count(1)


# --------------------------------------------------------------------------------------------------------------------
# Documents from position_ids
# --------------------------------------------------------------------------------------------------------------------


def document_starts(position_ids_BS: Tensor) -> Tensor:
    """Bool [B, S]: True where a document starts — at column 0 and wherever a position does not continue the previous
    one by +1 (a reset to 0 in lstune's packed batches; same rule as transformers' `find_packed_sequence_indices`)."""
    starts_BS = torch.ones_like(position_ids_BS, dtype=torch.bool)
    starts_BS[:, 1:] = position_ids_BS[:, 1:] != position_ids_BS[:, :-1] + 1
    return starts_BS


def document_ids(position_ids_BS: Tensor) -> Tensor:
    """Long [B, S]: index of each token's document within its row (0, 0, 1, 1, 1, 2, ...)."""
    return document_starts(position_ids_BS).cumsum(dim=1) - 1


# Document spans stated for position_ids that have no values (fake tensors in `lstune estimate --trace`).
_STATED_SPANS: ContextVar[list[list[tuple[int, int]]] | None] = ContextVar("lstune_stated_spans", default=None)


@contextmanager
def stated_document_spans(position_ids_BS: Tensor) -> Iterator[None]:
    """Within the block, position_ids without values (fake tensors) are taken to hold the documents of these real
    `position_ids_BS`: a memory trace computes them before faking the batch, since finding them needs the values."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():
        spans = document_spans(position_ids_BS)
    token = _STATED_SPANS.set(spans)
    try:
        yield
    finally:
        _STATED_SPANS.reset(token)


def document_spans(position_ids_BS: Tensor) -> list[list[tuple[int, int]]]:
    """Per row, the `(start, end)` token ranges of its documents. One host sync for the whole batch."""
    from torch._subclasses.fake_tensor import is_fake

    batch, seq = position_ids_BS.shape
    if is_fake(position_ids_BS):
        stated = _STATED_SPANS.get()
        if stated is None or len(stated) != batch or stated[0][-1][1] != seq:
            raise UserError("position_ids without values (fake tensors) need their documents stated: run inside "
                            "lstune.models.attention.stated_document_spans(real_position_ids).")
        return stated
    spans: list[list[int]] = [[] for _ in range(batch)]
    for row, col in document_starts(position_ids_BS).nonzero().tolist():
        spans[row].append(col)
    return [list(zip(starts, starts[1:] + [seq])) for starts in spans]


def cu_seqlens(position_ids_BS: Tensor) -> tuple[Tensor, int]:
    """flash-attn varlen metadata over the flattened batch: int32 cumulative document starts (with the total appended)
    and the longest document. Row starts are document starts, so documents never span rows."""
    total = position_ids_BS.numel()
    if total >= _INT32_LIMIT:
        raise UserError(
            f"{total:,} tokens per step overflow flash-attn's int32 cu_seqlens; use a smaller batch or sequence "
            "parallelism."
        )
    starts_T = document_starts(position_ids_BS).flatten().nonzero().flatten()
    total_1 = torch.tensor([total], device=starts_T.device)
    cu_N = torch.cat([starts_T, total_1]).to(torch.int32)
    return cu_N, int(cu_N.diff().max())


def _position_ids_for(query_BHSD: Tensor, position_ids_BS: Tensor | None) -> Tensor:
    """`position_ids` as [B, S] on the query's device; None means one document per row. HF passes [1, S] when it made
    them itself, whatever the batch size."""
    batch, _, seq, _ = query_BHSD.shape
    if position_ids_BS is None:
        return torch.arange(seq, device=query_BHSD.device).expand(batch, seq)
    if position_ids_BS.dim() != 2 or position_ids_BS.shape[-1] != seq or position_ids_BS.shape[0] not in (1, batch):
        raise UserError(
            f"position_ids has shape {tuple(position_ids_BS.shape)} but attention runs on {batch} rows of {seq} "
            "tokens; pass position_ids shaped [batch, seq] for the full sequence (under sequence parallelism, the "
            "gathered one)."
        )
    return position_ids_BS.to(query_BHSD.device).expand(batch, seq)


# --------------------------------------------------------------------------------------------------------------------
# Backend choice and refusals
# --------------------------------------------------------------------------------------------------------------------


# --------------------------------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------------------------------


def local_attention(
    query_BHSD: Tensor,
    key_BHSD: Tensor,
    value_BHSD: Tensor,
    *,
    position_ids_BS: Tensor | None = None,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    dropout: float = 0.0,
    backend: str = "auto",
    sinks: Tensor | None = None,
    block_kernel: Callable[..., Tensor] | None = None,
) -> Tensor:
    """Per-document causal attention of full-sequence q/k/v; returns `[B, S, H, D]` like HF's attention functions.

    `key_BHSD`/`value_BHSD` may have fewer heads than the query (GQA/MQA; H must be a multiple). `position_ids_BS`
    (full sequence, [B, S] or [1, S]) delimit documents; None means one document per row. `sliding_window` w lets a
    token see itself and the w-1 tokens before it, as transformers defines it. `softcap` c maps each scaled logit x to
    c·tanh(x/c) before the softmax (Gemma-2). `sinks`: learned attention-sink logits, one per query head (gpt-oss;
    `attention_sinks`). This is the kernel the Ulysses wrapper calls on head-sharded q/k/v.

    Sinks, and softcapping on the sdpa backend (SDPA cannot softcap), run `block_kernel`: lstune's block attention
    (`lstune.memory.block_attention.block_attention`, which returns and merges log-sum-exps), handed in by the
    layer that composes models and memory (`use_lstune_attention(..., block_kernel=...)`, as `lstune train` does).
    """
    _check_qkv(query_BHSD, key_BHSD, value_BHSD)
    position_ids_BS = _position_ids_for(query_BHSD, position_ids_BS)
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query_BHSD, key_BHSD, value_BHSD))
    requested, device_type = backend, query_BHSD.device.type
    backend = resolve_backend(
        backend, device_type=device_type, dtype=query_BHSD.dtype, softcap=softcap, dropout=dropout,
        needs_grad=needs_grad,
    )
    _log_backend_choice(requested, backend, device_type, query_BHSD.dtype)
    if sinks is not None or (softcap is not None and backend == "sdpa"):
        if block_kernel is None:
            what = "learned attention sinks" if sinks is not None else f"softcapped logits (softcap={softcap}) on sdpa"
            raise ModelError(_BLOCK_KERNEL_MESSAGE.format(what=what))
        return block_kernel(query_BHSD, key_BHSD, value_BHSD, position_ids_BS=position_ids_BS, scaling=scaling,
                            sliding_window=sliding_window, softcap=softcap, sinks=sinks, dropout=dropout)
    if backend == "flash_attention_2":
        return _flash_varlen_attention(
            query_BHSD, key_BHSD, value_BHSD, position_ids_BS, scaling, sliding_window, softcap, dropout
        )
    if backend == "flex":
        return _flex_attention(query_BHSD, key_BHSD, value_BHSD, position_ids_BS, scaling, sliding_window, softcap)
    return _sdpa_attention(query_BHSD, key_BHSD, value_BHSD, position_ids_BS, scaling, sliding_window, dropout)


@functools.cache
def _log_backend_choice(requested: str, chosen: str, device_type: str, dtype: torch.dtype) -> None:
    """Say once per combination which kernel "auto" (or an explicit choice) runs, so benchmarks can be read."""
    logger.info("lstune attention: backend %s -> %s on %s (%s)", requested, chosen, device_type, dtype)


def _check_qkv(query_BHSD: Tensor, key_BHSD: Tensor, value_BHSD: Tensor) -> None:
    """q and k share a head dim; v may have its own (multi-head latent attention: DeepSeek-V2/V3 read values of
    v_head_dim from queries/keys of qk_nope + qk_rope dims). k and v share batch, heads and sequence."""
    if query_BHSD.dim() != 4 or key_BHSD.dim() != 4 or value_BHSD.dim() != 4 or (
        key_BHSD.shape[:3] != value_BHSD.shape[:3]
    ):
        raise ValueError(
            f"expected q/k/v shaped [B, H, S, D], got {tuple(query_BHSD.shape)}, {tuple(key_BHSD.shape)}, "
            f"{tuple(value_BHSD.shape)}"
        )
    (batch, heads, seq, dim), (kv_batch, kv_heads, kv_seq, kv_dim) = query_BHSD.shape, key_BHSD.shape
    if kv_seq != seq:
        raise UserError(
            f"lstune attention is for training on whole sequences, but queries cover {seq} tokens and keys {kv_seq} "
            "(a KV cache, i.e. generation); call handle.undo() before generating."
        )
    if (kv_batch, kv_dim) != (batch, dim) or heads % kv_heads:
        raise ValueError(
            f"q {tuple(query_BHSD.shape)} and k/v {tuple(key_BHSD.shape)} do not match (GQA needs H % H_kv == 0)"
        )


def _sdpa_attention(
    query_BHSD: Tensor, key_BHSD: Tensor, value_BHSD: Tensor, position_ids_BS: Tensor, scaling: float | None,
    window: int | None, dropout: float,
) -> Tensor:
    """SDPA per document span. Rows with identical spans (e.g. every row one full document) share each call."""
    spans = document_spans(position_ids_BS)
    row_groups = [(slice(None), spans[0])] if all(s == spans[0] for s in spans) else [
        (slice(row, row + 1), row_spans) for row, row_spans in enumerate(spans)
    ]
    outs_BSHD = []
    for rows, row_spans in row_groups:
        pieces_BLHD = [
            _sdpa_causal(
                query_BHSD[rows, :, a:b], key_BHSD[rows, :, a:b], value_BHSD[rows, :, a:b], scaling, window, dropout
            )
            for a, b in row_spans
        ]
        outs_BSHD.append(torch.cat(pieces_BLHD, dim=1))  # contiguous, even for a single piece
    return outs_BSHD[0] if len(outs_BSHD) == 1 else torch.cat(outs_BSHD, dim=0)


def _sdpa_causal(
    query_BHLD: Tensor, key_BHLD: Tensor, value_BHLD: Tensor, scaling: float | None, window: int | None, dropout: float
) -> Tensor:
    """Causal attention within one document of L tokens, as a `[B, L, H, D]` view."""
    length = query_BHLD.shape[2]
    if window is not None and window < length:
        return _sdpa_windowed(query_BHLD, key_BHLD, value_BHLD, scaling, window, dropout)
    gqa = query_BHLD.shape[1] != key_BHLD.shape[1]
    out_BHLD = F.scaled_dot_product_attention(
        query_BHLD, key_BHLD, value_BHLD, dropout_p=dropout, is_causal=True, scale=scaling, enable_gqa=gqa
    )
    return out_BHLD.transpose(1, 2)


def _sdpa_windowed(
    query_BHLD: Tensor, key_BHLD: Tensor, value_BHLD: Tensor, scaling: float | None, window: int, dropout: float
) -> Tensor:
    """Sliding-window causal attention within one document, without an [L, L] mask.

    Steps: cut the queries into blocks of n = max(window, 256) tokens; block [a, b) attends to keys
    [max(0, a-window+1), b) under a banded bool mask (k <= q and q - k < window) of n x (n+window-1). Memory per call
    O(n·(n+window)); FLOPs at most ~2x the exact band. K/V heads are repeated per block because CUDA SDPA's
    masked kernels do not take GQA (they would fall back to the math kernel).
    """
    length, heads, kv_heads = query_BHLD.shape[2], query_BHLD.shape[1], key_BHLD.shape[1]
    block = max(window, _MIN_WINDOW_BLOCK)
    pieces_BNHD = []
    for a in range(0, length, block):
        b, k0 = min(a + block, length), max(0, a - window + 1)
        q_pos = torch.arange(a, b, device=query_BHLD.device)[:, None]
        k_pos = torch.arange(k0, b, device=query_BHLD.device)[None, :]
        band_NK = (k_pos <= q_pos) & (q_pos - k_pos < window)
        key_BHKD = key_BHLD[:, :, k0:b].repeat_interleave(heads // kv_heads, dim=1)
        value_BHKD = value_BHLD[:, :, k0:b].repeat_interleave(heads // kv_heads, dim=1)
        out_BHND = F.scaled_dot_product_attention(
            query_BHLD[:, :, a:b], key_BHKD, value_BHKD, attn_mask=band_NK, dropout_p=dropout, scale=scaling
        )
        pieces_BNHD.append(out_BHND.transpose(1, 2))
    return torch.cat(pieces_BNHD, dim=1)


def _flex_attention(
    query_BHSD: Tensor, key_BHSD: Tensor, value_BHSD: Tensor, position_ids_BS: Tensor, scaling: float | None,
    window: int | None, softcap: float | None,
) -> Tensor:
    """flex_attention with a document-causal (optionally windowed) BlockMask and a softcap score_mod.

    The BlockMask stores, per 128x128 tile, which key tiles to visit: O(B·(S/128)²) ints, and tiles outside every
    document are skipped, so packed batches cost only their documents' FLOPs. Compiled on CUDA (eager flex is a
    debugging path that materialises scores); forward-only on CPU.
    """
    from torch.nn.attention.flex_attention import flex_attention

    on_cuda = query_BHSD.is_cuda
    block_mask = _document_block_mask(position_ids_BS, window, compile_mask=on_cuda)
    score_mod = None
    if softcap is not None:

        def score_mod(score, batch, head, q_idx, kv_idx):
            return softcap * torch.tanh(score / softcap)

    kernel = _compiled(flex_attention) if on_cuda else flex_attention
    out_BHSD = kernel(
        *(_int32_safe(t) for t in (query_BHSD, key_BHSD, value_BHSD)),
        score_mod=score_mod,
        block_mask=block_mask,
        scale=scaling,
        enable_gqa=query_BHSD.shape[1] != key_BHSD.shape[1],
    )
    return out_BHSD.transpose(1, 2).contiguous()


def _document_block_mask(position_ids_BS: Tensor, window: int | None, *, compile_mask: bool) -> BlockMask:
    """The BlockMask of per-document causal (windowed) attention. Eager `create_block_mask` evaluates the mask over
    a dense [B, 1, S, S] grid first; compiled, inductor fuses that into the per-tile reduction, so nothing O(S²) is
    allocated — hence compiled on CUDA. Recompiles only when the window value changes (per layer type)."""
    from torch.nn.attention.flex_attention import create_block_mask

    doc_BS = document_ids(position_ids_BS)
    batch, seq = doc_BS.shape

    def document_causal(b, h, q_idx, kv_idx):
        allowed = (doc_BS[b, q_idx] == doc_BS[b, kv_idx]) & (kv_idx <= q_idx)
        return allowed if window is None else allowed & (q_idx - kv_idx < window)

    make_mask = _compiled(create_block_mask) if compile_mask else create_block_mask
    return make_mask(document_causal, batch, None, seq, seq, device=doc_BS.device)


@functools.cache
def _compiled(function: Callable[..., Any]) -> Callable[..., Any]:
    return torch.compile(function, dynamic=False)


def _int32_safe(tensor_BHSD: Tensor) -> Tensor:
    """A per-head contiguous copy when a token's element offset (s · seq-stride) would reach 2³¹ (see module doc)."""
    seq = tensor_BHSD.shape[2]
    return tensor_BHSD.contiguous() if seq * tensor_BHSD.stride(2) >= _INT32_LIMIT else tensor_BHSD


def _flash_varlen_attention(
    query_BHSD: Tensor, key_BHSD: Tensor, value_BHSD: Tensor, position_ids_BS: Tensor, scaling: float | None,
    window: int | None, softcap: float | None, dropout: float,
) -> Tensor:
    """FlashAttention-2 varlen over the flattened batch; one kernel call for all documents of all rows."""
    from flash_attn import flash_attn_varlen_func

    batch, heads, seq, dim = query_BHSD.shape
    value_dim = value_BHSD.shape[-1]
    scaling = scaling if scaling is not None else dim**-0.5  # padded q/k below must not change the default scale
    if value_dim != dim:  # flash-attn takes one head dim: zero-padded value columns give zero output columns
        value_BHSD = F.pad(value_BHSD, (0, dim - value_dim)) if value_dim < dim else value_BHSD
        if value_dim > dim:
            query_BHSD, key_BHSD = (F.pad(t, (0, value_dim - dim)) for t in (query_BHSD, key_BHSD))
    cu_N, longest = cu_seqlens(position_ids_BS)
    q_THD, k_THD, v_THD = (
        t.transpose(1, 2).reshape(batch * seq, t.shape[1], t.shape[-1]) for t in (query_BHSD, key_BHSD, value_BHSD)
    )
    # flash-attn's window is (left, right) tokens besides the query itself; transformers' window counts the query.
    window_size = (window - 1, 0) if window is not None and window < longest else (-1, -1)
    out_THD = flash_attn_varlen_func(
        q_THD, k_THD, v_THD, cu_N, cu_N, longest, longest,
        dropout_p=dropout, softmax_scale=scaling, causal=True, window_size=window_size, softcap=softcap or 0.0,
    )
    return out_THD.view(batch, seq, heads, out_THD.shape[-1])[..., :value_dim]


# --------------------------------------------------------------------------------------------------------------------
# transformers glue
# --------------------------------------------------------------------------------------------------------------------


def lstune_attention_forward(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    *,
    backend: str = "auto",
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    position_ids: Tensor | None = None,
    s_aux: Tensor | None = None,
    is_causal: bool | None = None,
    block_kernel: Callable[..., Tensor] | None = None,
    **_unused: Any,
) -> tuple[Tensor, None]:
    """An attention function with transformers' signature (`AttentionInterface`): refuses what it cannot honour, then
    runs `local_attention`. Other HF kwargs (output_attentions, cu_seq_lens_*, ...) are ignored: documents always
    come from `position_ids`, and no attention weights are ever materialised. `s_aux`: gpt-oss's attention sinks
    (under Ulysses, the rank's heads' slice)."""
    record_attention_module(module)
    sliding_window = window_from_mask(attention_mask, position_ids, sliding_window, query.shape[2], query.device)
    if not (is_causal if is_causal is not None else getattr(module, "is_causal", True)):
        raise ModelError(_BIDIRECTIONAL_MESSAGE.format(name=type(module).__name__))
    chunk = attention_mask.chunk if isinstance(attention_mask, ModelMask) else None
    sink = _CHUNK_SINK.get()
    if sink is not None:
        if chunk:  # the model's chunks are documents to FPDT too (its document key is index - position)
            if position_ids is None:
                raise ModelError(_CHUNKED_MASK_FPDT_MESSAGE.format(chunk=chunk))
            position_ids = chunk_positions(position_ids, chunk)
        out_BSHD = sink(query, key, value, position_ids=position_ids, scaling=scaling, sliding_window=sliding_window,
                        softcap=softcap, dropout=dropout, sinks=s_aux)
        return out_BSHD, None
    saver = _ATTENTION_SAVER.get()
    if saver is not None and s_aux is None and not chunk:
        # Saved attention (issue 33) keeps plain causal attention only: a layer with sinks (gpt-oss) or the model's
        # chunked attention (Llama-4) is recomputed, through local_attention below.
        out_BSHD = saver(query, key, value, position_ids=position_ids, scaling=scaling, sliding_window=sliding_window,
                         softcap=softcap, dropout=dropout, backend=backend)
        if out_BSHD is not None:
            return out_BSHD, None
    if chunk:
        position_ids = chunk_positions(_position_ids_for(query, position_ids), chunk)
    out_BSHD = local_attention(
        query, key, value, position_ids_BS=position_ids, scaling=scaling, sliding_window=sliding_window,
        softcap=softcap, dropout=dropout, backend=backend, sinks=s_aux, block_kernel=block_kernel,
    )
    return out_BSHD, None


# Chunked attention (lstune.memory.attention_chunks, FPDT): while a decoder layer's attention module runs on one
# chunk of the sequence, its q/k/v go to this sink instead of a kernel. The sink has `mask_positions` / `mask_seq`
# (the whole sequence the module got, for the model-mask check) and is called like `local_attention`.
_CHUNK_SINK: ContextVar[Any] = ContextVar("lstune_chunk_sink", default=None)


# While set, lstune's attention function appends the module calling it: which modules of a model are softmax
# attention, found by running it (a hybrid's linear-attention and state-space mixers never call it).
_ATTENTION_MODULES: ContextVar[list | None] = ContextVar("lstune_attention_modules", default=None)


def record_attention_module(module: Any) -> None:
    """Called by every softmax-attention kernel lstune installs (this module's, ring attention): while
    `recording_attention_modules` runs, `module` is appended to its list."""
    recorder = _ATTENTION_MODULES.get()
    if recorder is not None:
        recorder.append(getattr(module, "_module", module))  # the module itself, also inside Ulysses' view of it


@contextmanager
def recording_attention_modules() -> Iterator[list]:
    """Within the block, every module that calls lstune's attention function is appended to the yielded list."""
    calls: list = []
    token = _ATTENTION_MODULES.set(calls)
    try:
        yield calls
    finally:
        _ATTENTION_MODULES.reset(token)


def chunk_sink() -> Any:
    """The chunk sink while lstune's chunked attention runs a module on one chunk (`chunked_attention_calls`), else
    None: a kernel that wraps lstune's attention function (ring attention) hands its q/k/v to it."""
    return _CHUNK_SINK.get()


@contextmanager
def chunked_attention_calls(sink: Any) -> Iterator[None]:
    """Within the block, lstune's attention function hands q/k/v (one chunk's) to `sink` and returns its output."""
    token = _CHUNK_SINK.set(sink)
    try:
        yield
    finally:
        _CHUNK_SINK.reset(token)


# Saved attention (lstune.memory.attention_saved): while a checkpointed decoder layer runs, lstune's attention function
# first offers q/k/v to this saver, called like `local_attention` plus `backend`; it returns the output (computed and
# saved in the layer's first forward, the saved one in its recompute) or None to leave the call to `local_attention`.
_ATTENTION_SAVER: ContextVar[Any] = ContextVar("lstune_attention_saver", default=None)


@contextmanager
def saved_attention_calls(saver: Any) -> Iterator[None]:
    """Within the block, lstune's attention function offers q/k/v to `saver` first (None: no saver)."""
    token = _ATTENTION_SAVER.set(saver)
    try:
        yield
    finally:
        _ATTENTION_SAVER.reset(token)


def full_position_ids(query_BHSD: Tensor, position_ids_BS: Tensor | None) -> Tensor:
    """`position_ids` as `local_attention` reads them: [B, S] on the query's device (None: one document per row)."""
    return _position_ids_for(query_BHSD, position_ids_BS)


_CHUNKED_MASK_FPDT_MESSAGE = (
    "this model's layers with chunked attention ({chunk}-token chunks) do not pass position_ids to their attention, "
    "and lstune's chunked attention (FPDT) cuts the model's chunks by position; use --attn-chunks off (passing "
    "position_ids on to the attention layers would lift this, as lstune does for Llama-4)."
)
_BLOCK_KERNEL_MESSAGE = (
    "this model's attention has {what}, which lstune runs through its block attention kernel, and this attention "
    "function was installed without one: pass block_kernel=lstune.memory.block_attention.block_attention to "
    "use_lstune_attention (lstune train does)."
)


def _build_no_mask(
    *, attention_mask: Tensor | None = None, use_vmap: bool = False, mask_function: Callable | None = None,
    q_length: int | None = None, kv_length: int | None = None, q_offset: int = 0, kv_offset: int = 0,
    local_size: int | None = None, config: Any = None, **_unused: Any,
) -> ModelMask | None:
    """Mask function for `AttentionMaskInterface`: HF calls it instead of building a mask; it builds nothing and
    returns a `ModelMask` (the model's own index-based mask function and the window it named) that reaches the
    attention function in place of the mask, so a window a model applies only through its mask is kept.

    `use_vmap` is True exactly when the model overlays its own mask function (bidirectional or image-token blocks),
    which per-document causal attention would silently drop, so that is refused."""
    if use_vmap:
        raise ModelError(
            "this model overlays its own attention mask pattern (e.g. bidirectional or image-token attention); lstune "
            "attention implements causal per-document masks only."
        )
    if attention_mask is not None and not bool(attention_mask.all()):
        raise UserError(
            "the batch has an attention_mask with padding; lstune attention takes no padding mask. Pad at the end with "
            "-100 labels (padding then only sees itself and earlier tokens, and is never a target), or pack documents."
        )
    if mask_function is None or q_length != kv_length or q_offset or kv_offset:
        return None  # no mask asked for, or generation with a cache (refused by the attention function)
    # A config whose attention chunk (and no sliding window) has this size: the mask is most likely chunked attention
    # (Llama-4), checked first — on an SP rank's FPDT pieces no longer than a chunk both patterns fit the sample.
    chunked = (local_size is not None and getattr(config, "attention_chunk_size", None) == local_size
               and getattr(config, "sliding_window", None) != local_size)
    return ModelMask(mask_function, local_size, chunk_first=chunked)


@dataclass(eq=False)
class ModelMask:
    """Stands in for the mask a model asked transformers for: its mask function and the window (`local_size`) it
    named. One object per mask type per forward, shared by the layers of that type (and by their recomputes).

    `window_for(position_ids)` checks, once, that the model's mask is exactly per-document causal attention with that
    window — evaluated on sample query rows (every row up to 512 tokens) against lstune's rule — and returns the
    window. A mask of another shape (chunked attention, a window the mask function applies without naming it) is
    refused: lstune's kernels could not reproduce it.
    """

    mask_function: Callable
    local_size: int | None
    chunk: int | None = None  # set by `window_for` when the mask is chunked attention (Llama-4) of this size
    chunk_first: bool = False  # the config names an attention chunk of `local_size`: that pattern is checked first
    _checked: Any = field(default=None, repr=False)

    def __getattr__(self, name: str) -> Any:
        # Only reached for what a mask tensor has and this object has not: the model's own code computes with its
        # mask (Doge adds a learned per-key bias to it) before the attention function, which lstune cannot honour.
        if name.startswith("__"):
            raise AttributeError(name)
        raise MaskTensorUse(_MASK_TENSOR_MESSAGE.format(what=f"reads the mask's `{name}`"))

    def __getitem__(self, index: Any) -> Any:
        raise MaskTensorUse(_MASK_TENSOR_MESSAGE.format(what="slices the mask"))

    def window_for(self, position_ids_BS: Tensor | None, seq: int, device: Any = None,
                   agreed: Callable[[Callable[[], None]], None] | None = None) -> int | None:
        """`agreed`: under sequence parallelism, runs the check so that every rank of the group ends alike (each
        checks its own shard, and one may refuse what another accepts: lstune.parallel.comm.Communicator.agreed)."""
        if self._checked is not None and self._checked[0] is position_ids_BS and self._checked[1] == seq:
            return None if self.chunk else self.local_size
        from torch._subclasses.fake_tensor import is_fake

        agreed = agreed or (lambda check: check())
        if position_ids_BS is None:
            # The model does not hand position_ids to its attention: lstune sees one document per row, which is
            # right only if the model's own mask agrees (it separates packed documents when it detects them).
            agreed(functools.partial(self._check_without_positions, torch.arange(seq, device=device)[None]))
        elif not is_fake(position_ids_BS) and position_ids_BS.shape[-1] == seq:
            agreed(functools.partial(self._check, position_ids_BS))
        self._checked = (position_ids_BS, seq)
        return None if self.chunk else self.local_size

    def _check_without_positions(self, positions_BS: Tensor) -> None:
        try:
            self._check(positions_BS)
        except ModelError:
            raise ModelError(_NO_POSITIONS_MESSAGE) from None

    def _check(self, position_ids_BS: Tensor) -> None:
        """The mask is causal per document with the named window — or, failing that, chunked attention in chunks
        of the named size (`chunk`: every document cut every `local_size` positions, Llama-4). With `chunk_first`
        the other way round: where both fit the sample (no piece of a document longer than a chunk), the model's
        config decides."""
        if self.chunk_first:
            try:
                self._check_chunks(position_ids_BS)
                self.chunk = self.local_size
                return
            except ModelError:
                pass
        try:
            _check_model_mask(self.mask_function, position_ids_BS, self.local_size)
        except ModelError:
            if self.local_size is None:
                raise
            self._check_chunks(position_ids_BS)
            self.chunk = self.local_size

    def _check_chunks(self, position_ids_BS: Tensor) -> None:
        """Chunked attention in chunks of `local_size` positions. On an SP rank's shard that continues a document,
        transformers' mask (index-based when it sees no packing) counts chunks from the shard's first token, while
        the model on the whole sequence counts them from the document's start — as lstune's kernels do, from the
        global positions (`chunk_positions`). So the pattern is also accepted on the shard's own numbering."""
        try:
            _check_model_mask(self.mask_function, position_ids_BS, None, chunk=self.local_size)
        except ModelError:
            if bool((position_ids_BS[:, 0] == 0).all()):  # not a shard that continues a document
                raise
            shard_BS = position_ids_BS - position_ids_BS[:, :1]
            _check_model_mask(self.mask_function, shard_BS, None, chunk=self.local_size)


class MaskTensorUse(ModelError, AttributeError):
    """A model's own code used its attention mask as a tensor. An AttributeError too, so that `hasattr` and
    `getattr(mask, name, default)` in a model's code still see a mask without that attribute."""


_MASK_TENSOR_MESSAGE = (
    "this model's own code {what} before its attention runs: it computes with the mask tensor itself (a mask "
    "overlay, such as Doge's learned dynamic mask). lstune's attention builds no mask tensor (documents and "
    "causality come from position_ids), so it cannot train this model exactly; this model is not supported "
    "(lstune's limitation: passing the overlay to lstune's kernels as a score bias would lift it)."
)


def _check_model_mask(mask_function: Callable, position_ids_BS: Tensor, window: int | None,
                      chunk: int | None = None) -> None:
    """ModelError unless `mask_function`, within each document, allows exactly causal (windowed) attention on sample
    rows — or with `chunk`, causal attention within each document's chunks of `chunk` positions."""
    seq = position_ids_BS.shape[-1]
    doc_BS = document_ids(position_ids_BS)
    if chunk is not None:  # documents cut at every chunk start; a jump (an SP rank's FPDT pieces) cuts even where
        # the chunk positions happen to continue by +1 (positions 0..9 then 42 in 16-token chunks)
        starts_BS = document_starts(position_ids_BS) | document_starts(chunk_positions(position_ids_BS, chunk))
        doc_BS = starts_BS.cumsum(dim=1) - 1
    rows_R = _sample_rows(doc_BS, window)
    kv_S = torch.arange(seq, device=position_ids_BS.device)
    batch_B = torch.arange(doc_BS.shape[0], device=kv_S.device)
    head_1 = torch.zeros(1, dtype=torch.long, device=kv_S.device)
    for rows_r in rows_R.split(16):
        q_r1 = rows_r[:, None]
        model_BrS = mask_function(batch_B[:, None, None, None], head_1[None, :, None, None], q_r1[None, None],
                                  kv_S[None, None, None, :])
        model_BrS = torch.as_tensor(model_BrS, device=kv_S.device).expand(len(batch_B), 1, len(rows_r), seq)[:, 0]
        same_doc_BrS = doc_BS[:, rows_r, None] == doc_BS[:, None, :]
        ours_BrS = same_doc_BrS & (kv_S[None, None, :] <= q_r1[None])
        if window is not None:
            ours_BrS &= q_r1[None] - kv_S[None, None, :] < window
        # Documents always come from position_ids (HF skips its packed-sequence mask when a cache is passed).
        if not bool(torch.equal(model_BrS.bool() & same_doc_BrS, ours_BrS)):
            note = f" with a {window}-token sliding window" if window is not None else ""
            raise ModelError(_UNKNOWN_MASK_MESSAGE.format(window_note=note))


_UNKNOWN_MASK_MESSAGE = (
    "this model's attention mask is not causal per document{window_note}: it masks differently (a pattern set in "
    "its own mask code). lstune's attention kernels implement causal masks with sliding windows or chunks only, "
    "so it cannot train this model exactly; supporting that mask pattern in lstune's kernels would lift this."
)


_NO_POSITIONS_MESSAGE = (
    "this model does not pass position_ids to its attention layers, and its mask differs from one causal "
    "(windowed or chunked) document per row — packed documents, or a mask pattern lstune's kernels do not "
    "implement. lstune's attention takes documents from position_ids, so it cannot train this exactly: "
    "train without --pack, or, for another mask pattern, this model is not supported (lstune's limitation: "
    "passing position_ids on to the attention layers would lift the first)."
)


def chunk_positions(position_ids_BS: Tensor, chunk: int | None) -> Tensor:
    """position_ids under chunked attention (Llama-4's `attention_chunk_size`): each document restarts every `chunk`
    positions, so lstune's per-document causal kernels see each chunk as a document (a reset to 0 starts one).
    HF's mask cuts by the same positions in packed rows (remap_positions_for_packed_sequence)."""
    return position_ids_BS if chunk is None else position_ids_BS % chunk


def _sample_rows(doc_BS: Tensor, window: int | None) -> Tensor:
    """Every query row up to 512 tokens; beyond, rows at the ends, evenly spaced, and around the first document
    starts and their window edges."""
    seq = doc_BS.shape[-1]
    if seq <= 512:
        return torch.arange(seq, device=doc_BS.device)
    picks = [*range(32), *range(seq - 32, seq), *range(0, seq, max(1, seq // 64))]
    starts = (doc_BS[0, 1:] != doc_BS[0, :-1]).nonzero().flatten()[:16].add(1).tolist()
    for start in [0, *starts]:
        picks += [start, start + 1]
        if window is not None:
            picks += [start + window - 1, start + window, start + window + 1]
    return torch.tensor(sorted({p for p in picks if 0 <= p < seq}), device=doc_BS.device)


def window_from_mask(
    mask: Any, position_ids_BS: Tensor | None, sliding_window: int | None, seq: int, device: Any = None,
    agreed: Callable[[Callable[[], None]], None] | None = None,
) -> int | None:
    """The sliding window an attention call must apply: the one in the model's mask (`ModelMask`, checked), which
    must agree with the `sliding_window` the model passed to the attention call, if any (within the sequence).
    Inside chunked attention the call sees one chunk; the mask is checked on the whole sequence the module got.
    `agreed`: see `ModelMask.window_for` (a sequence-parallel caller's, which checks one shard per rank)."""
    sink = _CHUNK_SINK.get()
    if sink is not None:
        position_ids_BS, seq = sink.mask_positions, sink.mask_seq
    if mask is None:
        return sliding_window
    if not isinstance(mask, ModelMask):
        raise UserError(
            "lstune attention got an explicit attention mask; it builds none itself. Mark documents with position_ids "
            "resets and ignored tokens with -100 labels instead of passing attention_mask."
        )
    window = mask.window_for(position_ids_BS, seq, device, agreed)
    effective = [w if w is not None and w < seq else None for w in (window, sliding_window)]
    if sliding_window is not None and effective[0] != effective[1]:
        raise ModelError(
            f"this model masks attention with a {window}-token window but passes sliding_window={sliding_window} to "
            "its attention function; lstune cannot tell which the model means, so it does not train it."
        )
    return window


@dataclass
class AttentionHandle:
    """What `register_attention_function` changed on one model; `undo()` restores it (idempotent)."""

    key: str
    model: Any
    description: str
    _previous: list[tuple[Any, str | None]] = field(default_factory=list, repr=False)
    active: bool = True
    undos: list[Callable[[], None]] = field(default_factory=list, repr=False)  # hooks added beside the registration

    def undo(self) -> None:
        if not self.active:
            return
        for undo in reversed(self.undos):
            undo()
        for config, implementation in self._previous:
            hf_internals.restore_attention_implementation(config, implementation)
        hf_internals.unregister_attention(self.key)
        self.active = False
        logger.info("lstune attention: removed %r (%s); attention implementation restored", self.key, self.description)

    def __enter__(self) -> AttentionHandle:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.undo()


def register_attention_function(
    model: PreTrainedModel, attention_fn: Callable[..., tuple[Tensor, None]], *, description: str
) -> AttentionHandle:
    """Route `model`'s attention through `attention_fn` (transformers' attention-function signature), with no mask.

    Registers `attention_fn` and `_build_no_mask` under a fresh key ("lstune_<n>") and points the model's config (and
    sub-configs) at it. Other models keep their implementation: a new key changes nothing for configs that do not
    name it. The Ulysses wrapper registers its all-to-all function through here too.
    """
    _refuse_unsupported_model(model)
    key = f"lstune_{next(_registration_ids)}"
    hf_internals.register_attention(key, attention_fn, _build_no_mask)
    handle = AttentionHandle(key, model, description, _previous=_attention_configs(model))
    try:
        model.set_attn_implementation(key)
        if hf_internals.attention_implementation(model.config) != key:
            raise ModelError(
                f"{type(model).__name__} does not route attention through transformers' AttentionInterface, so lstune "
                "cannot install its attention; use a transformers-native architecture."
            )
    except BaseException:
        handle.undo()
        raise
    logger.info("lstune attention: registered %r (%s) for %s; transformers builds no attention mask for it",
                key, description, type(model).__name__)
    return handle


def use_lstune_attention(
    model: PreTrainedModel, *, backend: str = "auto", block_kernel: Callable[..., Tensor] | None = None
) -> AttentionHandle:
    """Make `model` run lstune's per-document causal attention (see module doc); `.undo()` restores it.

    `backend` is "auto" or one of BACKENDS; an unavailable one is refused now, the rest is decided per call from the
    tensors' device and dtype. `block_kernel`: lstune's block attention (`lstune.memory.block_attention`), for
    attention sinks and softcapping on sdpa (`local_attention`); without it a model with sinks is refused now.
    Applied after LoRA and before the memory techniques (the order of application in docs/memory.md).
    """
    _check_backend_name(backend)
    if backend != "auto":
        # The model may still be on CPU or meta and move to the GPU later: judge by what this machine has.
        device = "cuda" if torch.cuda.is_available() else "cpu"
        softcap = getattr(model.config, "attn_logit_softcapping", None)
        resolve_backend(backend, device_type=device, dtype=None, softcap=softcap, needs_grad=False)
    if block_kernel is None and (where := sinks_module(model)):
        raise ModelError(_BLOCK_KERNEL_MESSAGE.format(what=f"learned attention sinks ({where})"))
    attention_fn = functools.partial(lstune_attention_forward, backend=backend, block_kernel=block_kernel)
    handle = register_attention_function(model, attention_fn, description=f"backend={backend}")
    try:
        if _text_model_type(model) in POSITIONS_DROPPED:
            handle.undos.extend(pass_positions_to_layers(model))
        # Llama-4's decoder layers do not pass position_ids to attention, and its temperature reads token indices.
        from lstune.models.llama4 import install_llama4_attention

        adapter = install_llama4_attention(model)
    except BaseException:
        handle.undo()
        raise
    if adapter is not None:
        handle.undos.append(adapter.undo)
    return handle


# Model types whose body takes position_ids (its RoPE reads them) but whose decoder layers do not hand them on, so
# their attention would see one document per row: packed documents silently joined (their own HF mask is plain
# causal too), and no positions for Ulysses. A genuine exception (docs/models.md): most models pass them through
# the layers' **kwargs. Llama-4 is not here: its attention also scales queries by the local token index
# (lstune.models.llama4 hands its positions on and computes that scale from them).
POSITIONS_DROPPED = frozenset({"granitemoehybrid"})


def _text_model_type(model: Any) -> str:
    config = getattr(model, "config", None)
    getter = getattr(config, "get_text_config", None)
    return getattr(getter() if callable(getter) else config, "model_type", "")


def pass_positions_to_layers(model: Any) -> list[Callable[[], None]]:
    """Hand the body's `position_ids` to every decoder layer that is not given them (`models.position_hooks`), whose
    attention passes them on to lstune's attention function. Returns the hooks' removers."""
    from lstune.models.introspect import decoder_body, decoder_layers
    from lstune.models.position_hooks import hand_on_positions

    layers = decoder_layers(model)
    removers = hand_on_positions(decoder_body(model), layers)
    logger.info("lstune attention: position_ids handed to the %d decoder layers of %s (its layers drop them)",
                len(layers), type(model).__name__)
    return removers


def sinks_module(model: Any) -> str | None:
    """The name of the first module with learned attention sinks (a `sinks` tensor: gpt-oss), or None."""
    for name, module in model.named_modules():
        if isinstance(getattr(module, "sinks", None), torch.Tensor):
            return f"{type(module).__name__} {name}"
    return None


def _attention_configs(model: PreTrainedModel) -> list[tuple[Any, str | None]]:
    """Every config whose attention implementation `set_attn_implementation` may change, with its current value."""
    configs: dict[int, Any] = {}
    pending = [m.config for m in model.modules() if hasattr(getattr(m, "config", None), "sub_configs")]
    while pending:
        config = pending.pop()
        if id(config) in configs:
            continue
        configs[id(config)] = config
        pending.extend(sub for name in config.sub_configs if (sub := getattr(config, name, None)) is not None)
    return [(config, hf_internals.raw_attention_implementation(config)) for config in configs.values()]


def _refuse_unsupported_model(model: PreTrainedModel) -> None:
    """Structural refusals that must come before any forward: bidirectional attention."""
    problem = _bidirectional_problem(model.config)
    if problem:
        raise ModelError(problem)
