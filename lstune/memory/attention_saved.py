"""Saved attention: a checkpointed layer's backward does not re-run its attention forward (`--recompute-attention`).

Why: per-layer checkpointing (lstune.memory.checkpoint) re-runs each decoder layer's forward in backward to rebuild
what the layer's backward needs — attention's kernel included, the O(S²) part of the layer. Attention's backward
needs q, k and v (cheap: projections and rotary of the layer input, rebuilt by the recompute) and the forward's output
O with its log-sum-exp (FlashAttention's backward: P = exp(S - lse), delta = rowsum(dO ∘ O)). O and lse are O(S·h)
bytes per layer — about one checkpoint — while recomputing them costs 2·S²·h_q FLOPs (causal).

Steps:

1. Forward (checkpoint's first run of the layer): each attention call computes (O, lse) with the device's fused op
   that returns the lse (`attention_blocks.flash_ops`: on CPU PyTorch's flash op; on CUDA cuDNN's, then PyTorch's
   flash op — each probed once against the PyTorch kernel), per document span of `position_ids` as the sdpa path
   runs it, and keeps them beside the layer's checkpoint (`LayerSaves`): on the device, or in host memory where the
   checkpoint offloader put that layer's checkpoint (its copies, side streams, host budget, and the fetch one layer
   ahead: `CheckpointOffloader.keep_saved`).
2. Backward: checkpoint re-runs the layer; the attention call returns the saved O through `_SavedAttention` with no
   kernel, and that Function's backward runs the fused op's backward with the saved (O, lse) and the recomputed
   q, k, v. The layer's saves go once its attention's backward ran.
3. Chunked attention (lstune.memory.attention_chunks, FPDT) already keeps every chunk's k, v, O and lse for its own
   backward; its Function keeps that store in the same per-layer slot (`LayerSaves.next_entry`), and its recompute
   runs the module per chunk returning the saved O (no block kernels): one mechanism for both.

What is left to `local_attention` (and recomputed in backward, as before), each logged once: sliding windows
shorter than a document, softcapped logits and the flex backend, attention dropout, a v head dim other than q/k's,
dtypes or head dims no probed fused op takes, and layers whose checkpoint the placement does not store (MEMO
placement: those are re-run from their segment's base to save memory, so nothing is added there).

Memory: + S·(h_q·b + heads·4) bytes per layer (O in the activation dtype, lse fp32) from the layer's forward to its
backward — on the host where the layer's checkpoint is. Llama-3.1-8B in bf16: 8 KiB + 128 B per token per layer, as
much as its checkpoint. Cost: the attention forward in backward is gone (2·S²·h_q FLOPs per layer, causal); with
offload one more PCIe copy each way of S·h_q·b per layer, hidden under the layer's compute like the checkpoint's.
Composes with: offload and placement (above), tiled MLP/loss (they run in the recompute as before), LoRA, ZeRO-3 (no
weights here), Ulysses (the saver sees the rank's heads over the whole sequence: the saved O is the rank's shard,
S·h_q/sp per token), packing (per document span).
"""

from __future__ import annotations

import contextlib
import functools
import logging
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any, Callable, Iterator, Protocol

import torch

from lstune.memory.attention_blocks import (
    FLASH_OPS,
    MASKED,
    allowed_pairs,
    block_backward,
    FlashOps,
    flash_ops,
    span_backward,
    span_call,
    span_dtype,
    span_forward,
)
from lstune.models.attention import document_spans, full_position_ids, resolve_backend, saved_attention_calls

if TYPE_CHECKING:
    from torch import Tensor

logger = logging.getLogger("lstune")

RECOMPUTE_ATTENTION = ("auto", "on", "off")


class Keeper(Protocol):
    """Where a layer's saved tensors live (the checkpoint offloader; None: on the device)."""

    def keep_saved(self, index: int, tensor: Tensor) -> Any: ...
    def fetch_saved(self, handle: Any) -> Tensor: ...
    def prefetch_saved(self, handle: Any) -> None: ...


class _Entry:
    """One attention call's saved results: `declined` (left to `local_attention`), or the kernel's setting and its
    (O, lse) as the keeper placed them (`held`); `chunks`: chunked attention's saved store instead."""

    def __init__(self) -> None:
        self.declined = False
        self.ops: FlashOps | None = None
        self.fixed = False  # fake tensors (a memory trace): `ops` without probing or falling back
        self.dtype: torch.dtype | None = None
        self.scale = 1.0
        self.groups: list[tuple[slice, list[tuple[int, int]]]] = []
        self.held: list[Any] | None = None
        self.fetched: list[Tensor] | None = None
        self.fresh: tuple[Tensor, Tensor] | None = None  # (O, lse) just computed, for the first run's Function
        self.chunks: Any = None


_CURRENT: ContextVar[LayerSaves | None] = ContextVar("lstune_layer_saves", default=None)


def current_saves() -> LayerSaves | None:
    """The saves of the checkpointed layer running now (None outside one, or with attention recomputed)."""
    return _CURRENT.get()


class LayerSaves:
    """The saved attention results of one checkpointed layer call, one entry per attention call in call order.
    `wrap(run)` is the layer's forward that checkpoint runs (first forward, recompute) and a placement's segment
    re-runs: each run reads the entries from the first, the first run writes them."""

    def __init__(self, index: int, keeper: Keeper | None = None):
        self.index, self.keeper = index, keeper
        self.entries: list[_Entry] = []
        self._cursor = 0

    def wrap(self, run: Callable) -> Callable:
        def run_saved(hidden: Tensor):
            with self.running():
                return run(hidden)

        return run_saved

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        self._cursor = 0
        token = _CURRENT.set(self)
        try:
            with saved_attention_calls(self):
                yield
        finally:
            _CURRENT.reset(token)

    def next_entry(self) -> tuple[_Entry, bool]:
        """The entry of the run's next attention call, and whether it is new (the layer's first run)."""
        fresh = self._cursor >= len(self.entries)
        if fresh:
            self.entries.append(_Entry())
        entry = self.entries[self._cursor]
        self._cursor += 1
        return entry, fresh

    def keep(self, entry: _Entry, tensors: list[Tensor]) -> None:
        entry.held = [self.keeper.keep_saved(self.index, t) if self.keeper else t for t in tensors]

    def fetch(self, entry: _Entry) -> list[Tensor]:
        if entry.fetched is None:
            if entry.held is None:
                raise RuntimeError(f"layer {self.index}: saved attention read after its backward released it")
            entry.fetched = [self.keeper.fetch_saved(h) if self.keeper else h for h in entry.held]
        return entry.fetched

    def prefetch(self) -> None:
        """Start bringing the host parts of these saves back (the offloader calls this one layer ahead)."""
        if self.keeper is None:
            return
        for entry in self.entries:
            if entry.held is not None and entry.fetched is None:
                for handle in entry.held:
                    self.keeper.prefetch_saved(handle)

    @staticmethod
    def release(entry: _Entry) -> None:
        entry.held = entry.fetched = entry.chunks = None

    def __call__(self, query: Tensor, key: Tensor, value: Tensor, *, position_ids: Tensor | None,
                 scaling: float | None, sliding_window: int | None, softcap: float | None, dropout: float,
                 backend: str) -> Tensor | None:
        """lstune's attention function's call (models.attention.saved_attention_calls): the output, or None to leave
        the call to `local_attention` (recomputed in backward)."""
        entry, fresh = self.next_entry()
        if fresh:
            reason = _setup(entry, query, key, value, position_ids, scaling, sliding_window, softcap, dropout, backend)
            if reason:
                entry.declined = True
                _log_declined(reason)
        if entry.declined:
            return None
        if entry.held is None:  # the layer's first run: compute and keep (O, lse)
            try:
                with torch.no_grad():
                    entry.fresh = _forward(entry, query, key, value)
            except torch.OutOfMemoryError:
                raise
            except RuntimeError as failure:  # no fused op took it (attention_blocks.span_call): the plain path
                entry.declined = True
                _log_declined(f"no fused attention op ran ({failure})")
                return None
            self.keep(entry, [entry.fresh[0].detach(), entry.fresh[1]])
        return _SavedAttention.apply(self, entry, query, key, value)


@functools.cache
def _log_declined(reason: str) -> None:
    logger.info("saved attention: %s: that attention is recomputed in backward", reason)


def _setup(entry: _Entry, query, key, value, position_ids, scaling, window, softcap, dropout, backend) -> str | None:
    """Fill `entry`'s kernel setting for this call, or say why the call is left to `local_attention`."""
    from torch._subclasses.fake_tensor import is_fake

    if dropout:
        return "attention dropout"
    if softcap is not None:
        return "softcapped attention logits"
    chosen = resolve_backend(backend, device_type=query.device.type, dtype=query.dtype, softcap=softcap,
                             needs_grad=False)
    if chosen == "flex":
        return "the flex attention backend"
    if query.shape[-1] != key.shape[-1] or key.shape[-1] != value.shape[-1]:
        return "a value head dim other than the query's"
    dtype = span_dtype(query, key, value)
    if dtype is None:
        return "q, k and v in different dtypes"
    spans = document_spans(full_position_ids(query, position_ids))
    if window is not None and max(b - a for row in spans for a, b in row) > window:
        return "a sliding window shorter than a document"
    entry.fixed = is_fake(query)
    if entry.fixed:  # a memory trace: no values to probe with; the ops' fake kernels give the shapes
        ops = next((o for o in FLASH_OPS.get(query.device.type, ()) if dtype in o.dtypes), None)
    else:
        ops = flash_ops(query.device, dtype, query.shape[-1])
    if ops is None:
        return f"no fused attention op for {dtype} with head dim {query.shape[-1]} on {query.device.type}"
    entry.ops, entry.dtype = ops, dtype
    entry.scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    entry.groups = ([(slice(None), spans[0])] if all(s == spans[0] for s in spans)
                    else [(slice(row, row + 1), row_spans) for row, row_spans in enumerate(spans)])
    return None


class _SavedAttention(torch.autograd.Function):
    """Causal per-document attention of [B, H, S, D] q/k/v returning [B, S, H, D]: computed and kept by the layer's
    first run, the kept output in its recompute; backward from the kept (O, lse)."""

    @staticmethod
    def forward(ctx, saves: LayerSaves, entry: _Entry, query: Tensor, key: Tensor, value: Tensor) -> Tensor:
        if entry.fresh is not None:
            (out_BSHD, lse_BHS), entry.fresh = entry.fresh, None
        else:
            out_BSHD, lse_BHS = saves.fetch(entry)
        ctx.saves, ctx.entry = saves, entry
        ctx.save_for_backward(query, key, value, out_BSHD, lse_BHS)
        return out_BSHD.detach()

    @staticmethod
    def backward(ctx, dout_BSHD: Tensor):
        query, key, value, out_BSHD, lse_BHS = ctx.saved_tensors
        grads = _backward(ctx.entry, dout_BSHD, query, key, value, out_BSHD, lse_BHS)
        LayerSaves.release(ctx.entry)
        return (None, None, *(g.to(t.dtype) for g, t in zip(grads, (query, key, value))))


def _kernel(entry: _Entry, function: Callable, device: torch.device, head_dim: int) -> Callable:
    """`function` (span_forward / span_backward) on the entry's ops: fixed for fake tensors (a trace), else the
    device's first usable ones, falling back past ops that raise (`attention_blocks.span_call`)."""
    options = dict(causal=True, scale=entry.scale, dtype=entry.dtype)
    if entry.fixed:
        return functools.partial(function, entry.ops, **options)

    def run(*args):
        try:
            return span_call(functools.partial(function, **options), device, entry.dtype, head_dim, *args)
        except torch.OutOfMemoryError:
            raise
        except RuntimeError:
            if function is not span_backward:
                raise
            # Every fused op refused this span's backward after its forward ran: the PyTorch kernel, exact.
            return _torch_span_backward(*args, scale=entry.scale, dtype=entry.dtype)

    return run


def _torch_span_backward(dout4: Tensor, q4: Tensor, k4: Tensor, v4: Tensor, out4: Tensor, lse: Tensor, *,
                         scale: float, dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    """One causal span's backward with attention_blocks' PyTorch kernel (fp32 scores in row tiles) from the kept
    (O, lse): the last resort when no fused op runs it."""
    batch, heads, t, dim = q4.shape
    kv_heads = k4.shape[1]
    q5, dout5, out5 = (x.reshape(batch, kv_heads, heads // kv_heads, t, x.shape[-1]) for x in (q4, dout4, out4))
    delta = (dout5.float() * out5.float()).sum(-1)
    index = torch.arange(t, device=q4.device).expand(batch, t)
    allowed = allowed_pairs(index, index * 0, index, index * 0, None)
    dq5, dk, dv = block_backward(MASKED, q5.to(dtype), k4.to(dtype), v4.to(dtype), dout5.to(dtype),
                                 (delta, lse.reshape(delta.shape)), allowed, scale, None)
    return dq5.reshape(q4.shape).to(dtype), dk.to(dtype), dv.to(dtype)


def _forward(entry: _Entry, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """(O [B, S, H, D] contiguous in the span dtype, lse [B, H, S] fp32), one fused call per document span."""
    batch, heads, seq, _ = q.shape
    run = _kernel(entry, span_forward, q.device, q.shape[-1])
    if len(entry.groups) == 1 and entry.groups[0][1] == [(0, seq)]:
        out4, lse = run(q, k, v)
        return out4.transpose(1, 2).contiguous(), lse
    out_BSHD = q.new_empty((batch, seq, heads, v.shape[-1]), dtype=entry.dtype)
    lse_BHS = q.new_empty((batch, heads, seq), dtype=torch.float32)
    for rows, spans in entry.groups:
        for a, b in spans:
            out4, lse = run(q[rows, :, a:b], k[rows, :, a:b], v[rows, :, a:b])
            out_BSHD[rows, a:b] = out4.transpose(1, 2)
            lse_BHS[rows, :, a:b] = lse
    return out_BSHD, lse_BHS


def _backward(entry: _Entry, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor):
    """(dq, dk, dv) shaped as q, k, v, one fused backward per document span."""
    run = _kernel(entry, span_backward, q.device, q.shape[-1])
    seq = q.shape[2]
    if len(entry.groups) == 1 and entry.groups[0][1] == [(0, seq)]:
        return run(dout.transpose(1, 2), q, k, v, out.transpose(1, 2), lse)
    dq, dk, dv = (torch.empty(t.shape, dtype=entry.dtype, device=t.device) for t in (q, k, v))
    for rows, spans in entry.groups:
        for a, b in spans:
            grads = run(dout[rows, a:b].transpose(1, 2), q[rows, :, a:b], k[rows, :, a:b], v[rows, :, a:b],
                        out[rows, a:b].transpose(1, 2), lse[rows, :, a:b])
            for total, grad in zip((dq, dk, dv), grads):
                total[rows, :, a:b] = grad
    return dq, dk, dv

