"""Chunked, offloaded attention (FPDT, paper 003 Sec. 4) for any Hugging Face causal LM: `--attn-chunks`.

Why: with tiled MLP/loss and offloaded checkpoints, the largest term left on the device is the attention block's
working set in backward — the full-sequence q, k, v, attention output, their gradients and the projections'
inputs (FPDT Table 2: 3Nd + 4Nd forward, 6Nd + 8Nd backward per layer). This runs the attention block over the
sequence in M chunks, the way a model runs prefill with a cache, so the device holds O(S/M) of it.

Steps (one custom autograd Function per attention module call; model code untouched):

1. Forward, chunk m = 0..M-1: the module's own forward runs on `hidden[:, chunk m]` with the chunk's position
   embeddings / position_ids, so its per-token parts (norm if inside, q/k/v projections, q/k-norms, rotary,
   output projection) see one chunk. lstune's attention function hands chunk m's q/k/v to this module's sink
   (`models.attention.chunked_attention_calls`), which keeps k_m/v_m and returns chunk m's output: its queries
   against the keys/values of chunks i <= m with online-softmax merging (o = Σ_i exp(lse_i - lse)·o_i,
   lse = log Σ_i exp(lse_i)). Masks come from global token indices and position_ids (same document: equal
   `index - position`; causal: `k <= q`; window: `q - k < w`), so only the diagonal block is cut by causality,
   packed documents and sliding windows hold, and softcapping is a score map. position_ids must continue by +1 or
   restart at 0 in global order (checked once per call; under SP this also refuses contiguous shards, below).
   Saved per chunk: k, v, the output o and its log-sum-exp — in pinned host memory when offloading (in power-of-two
   pieces, memory.host_copies; copied on a side stream; read back on a schedule that starts each copy at least one
   compute unit ahead, `_ChunkStore`),
   on the device otherwise; and the module's input. No per-chunk autograd graph is kept.
2. Backward (a), per chunk: re-run the module with grad, the attention output a leaf; its gradient dO_m through
   the output projection alone (`torch.autograd.grad` w.r.t. the leaf); q_m is recorded on the way.
3. Backward (b), FPDT's order: outer loop over key/value chunks i, inner over query chunks j >= i (from the last
   to the diagonal, so dq_i, final after the diagonal, stays on the device for (c)). Block (j, i)'s
   gradient is FlashAttention's backward with the merged o_j and lse_j (P = exp(S - lse_j), dV += Pᵀ dO,
   dS = P ∘ (dO Vᵀ - rowsum(dO ∘ o_j)), dQ += dS K, dK += dSᵀ Q) — exactly the gradient of the merge. dk_i/dv_i
   are complete after outer iteration i, and so is dq_i (its contributions come from kv chunks <= i).
4. Backward (c), right after outer iteration i: re-run the module on chunk i with grad and backpropagate
   (dOut_i, dq_i, dk_i, dv_i) into the chunk's input and the weights (returned once, summed over chunks; under
   ZeRO-3 into `.grad`, as `tiling.sequence_tiled` does).

Memory (one layer, S tokens, chunk c = S/M, d = hidden, hq/hkv = q/kv widths): device, without offload:
S·(2·hkv + hq)·b saved (k, v, o) plus O(c·(d + hq + 2·hkv)) working set and O(c²·heads) score tiles; with
offload the saved terms move to the host and the device holds O(c) plus the module's input, output and input
gradient (3·S·d, the residual stream, not attention's). Host: S·(2·hkv + hq)·b + S·heads·4 (lse) per layer while
it is live, plus dO and dq accumulators in backward.
Cost: the per-token parts run three times (forward, (a), (c); four under checkpointing) instead of once (twice);
attention FLOPs are those of causal attention over whole blocks (the diagonal block is computed in full and
masked), plus one recompute of the scores in backward as FlashAttention does; with offload, k/v are read from the
host (M·(M+1)/2 chunk reads per pass). Block kernels (`attention_blocks`): a block inside one document and one
window, not softcapped, runs PyTorch's flash-attention op (returns the lse; its backward takes the merged o and lse),
causal on the diagonal — once a one-time probe per (device, dtype, head dim) found the op equal to the pure-PyTorch
kernel (fp32 scores, query rows sub-tiled to bound the score tile), which runs every other block and fake tensors.
Composes with: activation checkpointing (the checkpoint's recompute runs this Function again; the saved chunks go
through `save_for_backward`, so checkpoint's hooks drop and recompute them), tiled MLP / loss, LoRA (peft-wrapped
projections run per chunk), ZeRO-3 (weights gathered per use by ZeRO's hooks, gradients into `.grad`), Ulysses SP
with FPDT's token layout (lstune.models.chunk_layout): the SP data adapter cuts the padded sample into sp·M equal
pieces of c tokens and rank r holds pieces r, r+sp, …, r+(M-1)·sp, so the Ulysses all-to-all of every rank's chunk m
is the contiguous stretch [m·sp·c, (m+1)·sp·c) of the sample; its global indices are m·sp·c + offset, chunk m
attends chunks <= m only, and the steps above run unchanged (no extra forward pass, no delayed dq). The sink reads
the layout with the adapter's function (`sequence_layout`), so both cut the same chunks; a batch in contiguous
shards (an adapter not given the chunk setting) is refused — by its chunk length when it does not cut into equal
chunks, else by its gathered position_ids, which then jump mid-document (a packing whose documents exactly fill
pieces could slip through: give the adapter `chunks=MemoryPlan.attn_chunking`). Attention dropout is refused.

Under Ulysses × ring (`--sp-ring` R > 1; docs/parallel.md): the layout is chunk-major (the ring's zigzag inside each
chunk, `chunk_layout`), and ring attention hands each chunk's call to the sink with its ring group. The sink's queries
are then the ring position's two zigzag pieces of chunk m; it all-gathers chunk m's K/V and position_ids over the
ring once, in global order (`_ChunkSink._ring_chunk`), and stores them — the keys of chunk m are the whole chunk,
with their own token ids beside the queries' ("q_idx", "q_doc"). Chunks < m lie wholly before the queries (FPDT's
blocks unchanged); the diagonal block (pieces against their whole chunk) runs the PyTorch kernel with its mask. In
backward, key chunk i's fp32 dk/dv (the whole chunk's) are summed over the ring and sent home
(`ring_reduce_scatter`) before phase (c). Memory: the store holds the K/V of the whole sequence for the rank's heads
(R times the above per rank, on the host with offload); one gathered chunk's fp32 dk/dv. Traffic: each chunk's K/V
once per pass (the ring's hops' bytes), its fp32 dk/dv once in backward; synchronous (not overlapped).
"""

from __future__ import annotations

import functools
import logging
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch.autograd.function import once_differentiable

from lstune.errors import DataError, ModelError, UserError
from lstune.memory.attention_blocks import MASKED, allowed_pairs, block_backward, block_forward, block_kinds, merge
from lstune.memory.attention_saved import LayerSaves, current_saves
from lstune.memory.offload_math import (  # noqa: F401  (re-exported: chunked attention's sizes live with their math)
    auto_chunk_tokens, chunk_count, offload_copy_bytes)
from lstune.memory.host_copies import HostBlocks
from lstune.memory.patching import FusedNorm, Undo, patch_forward
from lstune.memory.tiling import (
    _accumulate,
    _autocast_state,
    _replay_autocast,
    _replay_rng,
    _RngState,
    _Zero3Readiness,
    is_zero3_partitioned,
    tile_bounds,
)
from lstune.models.attention import chunked_attention_calls
from lstune.models.attention_sinks import apply_sinks, grouped_sinks, rowsums, sink_gradient
from lstune.models.chunk_layout import AttentionChunks, SequenceLayout, sequence_layout
from lstune.models.introspect import attention_heads, layer_attention

if TYPE_CHECKING:
    from torch import Tensor, nn

logger = logging.getLogger("lstune")

# Arguments of an attention module's forward that run along the sequence, and their sequence dimension.
_PER_TOKEN_ARGS = {"position_embeddings": -2, "position_ids": -1, "cache_position": -1}






def attention_widths(config: Any) -> tuple[int, int]:
    """(h_q, h_kv) = (heads, kv heads) · head_dim of a transformers (text) config; (0, 0) without attention."""
    heads = attention_heads(config)
    if heads is None:
        return 0, 0
    q_heads, kv_heads, head_dim = heads
    return q_heads * head_dim, kv_heads * head_dim


def attention_chunking(setting: str | int, config: Any) -> AttentionChunks:
    """`--attn-chunks` for a model of this (transformers) config: "auto" chunks of its `auto_chunk_tokens`; off for a
    model without attention (nothing to chunk)."""
    widths = attention_widths(config)
    if widths == (0, 0):
        return AttentionChunks("off")
    return AttentionChunks(setting, auto_chunk_tokens(*widths))




def chunk_bounds(chunks: AttentionChunks, seq_len: int) -> list[tuple[int, int]]:
    """The chunks [(start, stop), ...] of a local sequence: equal when their count divides it (always under SP, where
    `chunk_layout.sequence_layout` pads samples for it)."""
    return tile_bounds(seq_len, chunks.count(seq_len))


@dataclass
class ChunkStats:
    """Host bytes held by offloaded chunks right now and at most (live storages, freed when their last user goes);
    the bytes copied each way; the reads of host chunks whose copy started at least one compute unit before (its
    time hidden on CUDA when the unit lasts as long as the copy) and those whose copy started when they were needed."""

    host_bytes: int = 0
    peak_host_bytes: int = 0
    bytes_to_host: int = 0
    bytes_from_host: int = 0
    reads_ahead: int = 0
    reads_late: int = 0

    def add(self, host: HostBlocks) -> None:
        for block in host.blocks:
            nbytes = block.untyped_storage().nbytes()
            self.host_bytes += nbytes
            weakref.finalize(block.untyped_storage(), self._release, nbytes)
        self.peak_host_bytes = max(self.peak_host_bytes, self.host_bytes)

    def _release(self, nbytes: int) -> None:
        self.host_bytes -= nbytes


def install_chunked_attention(
    layers: nn.ModuleList, setting: str | int, *, auto_tokens: int | None = None, offload: bool, stats: ChunkStats | None = None,
    fused: dict[int, tuple[str | None, str | None]] | None = None, names: tuple[str | None, ...] | None = None,
) -> list[Undo]:
    """Make every layer's attention module run in chunks (module doc); returns the undos.

    `names`: each layer's attention attribute (`introspect.attention_names`), None for a hybrid's layer without
    softmax attention (linear attention, state-space, convolution: O(S) already), which is left alone; looked up
    structurally when not given (`layer_attention`).

    `fused[i] = (pre_norm_name, post_norm_name)`: layer i's norms feeding only the attention / fed only by it (found
    by `mlp.find_fusable_norms` from a probe) run inside each chunk instead — the layer calls them as identities —
    so their fp32 copies (HF RMSNorm upcasts) and the normed hidden state are O(chunk), as in mini-sequence."""
    chunks = AttentionChunks(setting, auto_tokens)
    if setting == "off":
        return []
    undos = []
    names = names or tuple(layer_attention(layer) for layer in layers)
    for index, layer in enumerate(layers):
        if names[index] is None:
            continue
        module = getattr(layer, names[index])
        norms = [getattr(layer, name) if name else None for name in (fused or {}).get(index, (None, None))]
        for norm, side in zip(norms, ("pre", "post")):
            if norm is not None:
                what = f"layer {index}: {side}-attention norm in the chunks"
                undos.append(FusedNorm.install(norm, what=what))
        chunked = ChunkedAttention(module, module.forward, chunks, offload=offload, stats=stats, norms=norms)
        undos.append(patch_forward(module, chunked, what=f"chunked attention, layer {index}"))
    logger.info("chunked attention (FPDT): %d layers, %s, saved chunks %s, %d norms fused",
                sum(n is not None for n in names),
                chunks.describe(), "offloaded to host" if offload else "on the device",
                sum(n is not None for pair in (fused or {}).values() for n in pair))
    return undos


class ChunkedAttention:
    """The patched forward of one attention module: unchunked when one chunk covers the sequence."""

    def __init__(self, module: nn.Module, forward: Callable, chunks: AttentionChunks, *, offload: bool,
                 stats: ChunkStats | None, norms: list[nn.Module | None] | None = None):
        self.module, self.forward, self.chunks, self.offload = module, forward, chunks, offload
        self.stats = stats if stats is not None else ChunkStats()
        self.pre, self.post = norms or (None, None)
        self.modules = [m for m in (self.pre, module, self.post) if m is not None]

    def run(self, hidden_BSD: Tensor, *args: Any, **kwargs: Any) -> Any:
        """The attention module's forward with its fused norms around it."""
        if self.pre is not None:
            hidden_BSD = FusedNorm.call(self.pre, hidden_BSD)
        result = self.forward(hidden_BSD, *args, **kwargs)
        if self.post is None:
            return result
        if isinstance(result, tuple):
            return (FusedNorm.call(self.post, result[0]), *result[1:])
        return FusedNorm.call(self.post, result)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        hidden_BSD, rest, kwargs = _split_hidden(args, kwargs)
        seq = hidden_BSD.shape[1]
        bounds = chunk_bounds(self.chunks, seq)
        if len(bounds) <= 1:
            return self.run(hidden_BSD, *rest, **kwargs)
        if kwargs.get("past_key_values") is not None or kwargs.get("past_key_value") is not None:
            raise UserError("chunked attention is for training on whole sequences; it got a KV cache (generation): "
                            "undo the memory plan (or use --attn-chunks off) before generating.")
        spec = _ChunkSpec(self, bounds, seq, rest, kwargs)
        trainable = tuple(p for m in self.modules for p in m.parameters() if p.requires_grad)
        if any(is_zero3_partitioned(p) for p in trainable):
            spec.into_grad = trainable
            # Partitioned weights cannot be Function inputs; an empty leaf keeps the output in the graph.
            out_BSD = _ChunkedAttentionFunction.apply(spec, hidden_BSD, hidden_BSD.new_empty(0).requires_grad_())
        else:
            out_BSD = _ChunkedAttentionFunction.apply(spec, hidden_BSD, *trainable)
        return (out_BSD, *([None] * (spec.result_len - 1))) if spec.result_len else out_BSD


def _split_hidden(args: tuple, kwargs: dict) -> tuple[Tensor, tuple, dict]:
    kwargs = dict(kwargs)
    if args:
        return args[0], args[1:], kwargs
    if "hidden_states" not in kwargs:
        raise ModelError("chunked attention: the attention module was called without hidden_states; use "
                         "--attn-chunks off for this model.")
    return kwargs.pop("hidden_states"), (), kwargs


@dataclass(eq=False)
class _ChunkSpec:
    """One attention call cut into chunks: how to run the module on chunk m, and its sink."""

    owner: ChunkedAttention
    bounds: list[tuple[int, int]]
    seq: int
    args: tuple
    kwargs: dict
    into_grad: tuple = ()
    result_len: int = 0  # length of the module's result tuple (0: a bare tensor)
    sink: _ChunkSink = field(init=False)

    def __post_init__(self) -> None:
        for i, arg in enumerate(self.args):
            _refuse_sequence_tensor(f"positional argument {i + 1}", arg, self.seq)
        for name, value in self.kwargs.items():
            if name not in _PER_TOKEN_ARGS:
                _refuse_sequence_tensor(name, value, self.seq)
        self.sink = _ChunkSink(self, self.kwargs.get("position_ids"))

    def run(self, hidden_BcD: Tensor, m: int, mode: str) -> Tensor:
        """The module's own forward on chunk m (its hidden slice), attention calls going to the sink in `mode`."""
        a, b = self.bounds[m]
        kwargs = {name: _narrow(value, _PER_TOKEN_ARGS[name], a, b, self.seq) if name in _PER_TOKEN_ARGS else value
                  for name, value in self.kwargs.items()}
        self.sink.begin(m, mode)
        with chunked_attention_calls(self.sink):
            result = self.owner.run(hidden_BcD, *self.args, **kwargs)
        self.sink.end()
        if isinstance(result, tuple):
            if any(extra is not None for extra in result[1:]):
                raise ModelError(f"{type(self.owner.module).__name__} returns more than its output (attention weights "
                                 "or a cache); chunked attention cannot run it: use --attn-chunks off.")
            self.result_len = len(result)
            return result[0]
        return result


def _refuse_sequence_tensor(name: str, value: Any, seq: int) -> None:
    if name == "attention_mask" and isinstance(value, torch.Tensor):
        raise ModelError("chunked attention needs lstune's attention (--attn auto|sdpa|flex|flash_attention_2), which "
                         "takes no [seq, seq] mask; this model got one from transformers' own attention.")
    if isinstance(value, torch.Tensor) and value.dim() and seq in value.shape:
        raise ModelError(f"the attention module takes a per-token argument {name!r} (shape {tuple(value.shape)}) "
                         "that chunked attention does not know how to cut; use --attn-chunks off for this model.")


def _narrow(value: Any, dim: int, a: int, b: int, seq: int) -> Any:
    """A per-token argument cut to tokens [a, b) (tuples such as (cos, sin) element-wise); None stays None."""
    if isinstance(value, (tuple, list)):
        return type(value)(_narrow(v, dim, a, b, seq) for v in value)
    if isinstance(value, torch.Tensor) and value.dim() >= -dim and value.shape[dim] == seq:
        return value.narrow(dim, a, b - a)
    return value


# --------------------------------------------------------------------------------------------------------------------
# The sink: what lstune's attention function calls with one chunk's q/k/v
# --------------------------------------------------------------------------------------------------------------------


class _ChunkSink:
    """Receives chunk m's q/k/v ([B, H, n, D] — n = chunk tokens, or sp·chunk tokens under Ulysses: a contiguous
    stretch of the sample in FPDT's layout) and, by mode: "forward": keeps k/v and returns o_m merged over chunks
    0..m (keeps o, lse); "replay": records q_m and returns the saved o_m as a grad-requiring leaf; "backward": records
    q/k/v (with their graph) and returns the saved o_m."""

    def __init__(self, spec: _ChunkSpec, position_ids: Tensor | None):
        self.spec = spec
        self.mask_positions, self.mask_seq = position_ids, spec.seq
        self.store: _ChunkStore | None = None
        self.config: dict[str, Any] = {}
        self.m, self.mode, self.calls = 0, "", 0
        self.leaf: Tensor | None = None
        self.captured: tuple[Tensor, ...] = ()
        self.sources: dict[int, dict[int, str]] = {}  # query chunk -> {key chunk it attends: block kind}
        self.order = _PositionOrder()
        self.gathered = False  # the calls see every SP rank's chunk m (Ulysses)
        self.sink_grads: dict[int, Tensor] = {}  # query chunk -> its part of the attention sinks' gradient

    def begin(self, m: int, mode: str) -> None:
        self.m, self.mode, self.calls = m, mode, 0

    def end(self) -> None:
        if self.calls != 1:
            raise ModelError(
                f"{type(self.spec.owner.module).__name__} called lstune's attention function {self.calls} times for "
                "one chunk (expected once): chunked attention needs lstune's attention (--attn auto|sdpa|flex|"
                "flash_attention_2) and one attention call per module: use --attn-chunks off for this model."
            )

    def __call__(self, query: Tensor, key: Tensor, value: Tensor, *, position_ids: Tensor | None,
                 scaling: float | None, sliding_window: int | None, softcap: float | None, dropout: float,
                 sinks: Tensor | None = None, ring: Any = None) -> Tensor:
        """`ring`: the ring group (lstune.memory.rotation.Ring) when ring attention hands over its call (chunked
        attention under Ulysses × ring): the call's tokens are then the ring position's two zigzag pieces of chunk m,
        whose keys/values are gathered over the ring (`_ring_chunk`)."""
        self.calls += 1
        if dropout:
            raise ModelError(f"chunked attention has no attention dropout (got {dropout}); set attention_dropout=0 "
                             "in the model config or use --attn-chunks off.")
        store, m = self.store, self.m
        if self.mode == "forward":
            sinks5 = None if sinks is None else grouped_sinks(sinks, key.shape[1])
            ring = ring if ring is not None and ring.size > 1 else None
            self.config = dict(scale=scaling if scaling is not None else query.shape[-1] ** -0.5,
                               window=sliding_window, softcap=softcap, kv_heads=key.shape[1], sinks=sinks5, ring=ring)
            if ring is not None:
                key, value = self._ring_chunk(query, key, value, position_ids, ring)
            else:
                index_Bn, doc_Bn = self._token_ids(query, position_ids)
                store.put(("idx", m), index_Bn, offload=False)
                store.put(("doc", m), doc_Bn, offload=False)
            store.put(("k", m), _own(key.detach()))
            store.put(("v", m), _own(value.detach()))
            out5, lse = _chunk_forward(self, query, key, value)
            store.put(("o", m), out5)
            store.put(("lse", m), lse)
            return _out_layout(out5)
        out_BnHD = _out_layout(store.get(("o", m), query.device))
        if self.mode == "saved":  # a checkpoint's recompute with the layer's first forward saved (attention_saved)
            return out_BnHD
        if self.mode == "replay":
            store.put(("q", m), _to5(query.detach(), key.shape[1]))
            self.leaf = out_BnHD.requires_grad_()
            return self.leaf
        self.captured = (query, key, value, sinks)
        return out_BnHD

    def _token_ids(self, query: Tensor, position_ids: Tensor | None) -> tuple[Tensor, Tensor]:
        """Global token index and document key (index - position, equal exactly within a document when documents
        after a row's first start at position 0) of each of the call's n tokens: chunk m's, or under Ulysses every
        rank's chunk m, which FPDT's layout makes one contiguous stretch (`chunk_layout.sequence_layout`)."""
        a, b = self.spec.bounds[self.m]
        batch, n = query.shape[0], query.shape[2]
        start = a if n == b - a else self._gathered_start(n)
        index_n = torch.arange(start, start + n, device=query.device)
        if position_ids is None:
            return index_n.expand(batch, n), torch.zeros(batch, n, dtype=torch.long, device=query.device)
        positions_Bn = position_ids.to(query.device).expand(batch, n)
        self.order.follow(positions_Bn)
        return index_n.expand(batch, n), index_n - positions_Bn

    def _ring_chunk(self, query: Tensor, key: Tensor, value: Tensor, position_ids: Tensor | None,
                    ring: Any) -> tuple[Tensor, Tensor]:
        """Under a ring (chunk-major zigzag layout, `chunk_layout`): chunk m's keys/values all-gathered over the ring
        (GQA-compressed, this rank's Ulysses heads) and put in global order — the whole chunk, which this rank's
        queries of chunk m and of every later chunk attend; stored with the chunk's global indices and document keys
        ("idx", "doc") beside the queries' own ("q_idx", "q_doc": the ring position's two pieces). Returns the
        gathered key and value; their gradients go home by `ring_reduce_scatter` in backward."""
        import torch.distributed as dist

        if position_ids is None:
            raise ModelError("chunked attention under ring attention needs position_ids at every attention call; use "
                             "--sp-ring 1 or --attn-chunks off.")
        a, b = self.spec.bounds[self.m]
        batch, n = query.shape[0], query.shape[2]
        if n % (b - a) or n % 2:
            raise DataError(_NOT_FPDT_ORDER.format(n=n, seq=self.spec.seq, chunks=len(self.spec.bounds)))
        span = n * ring.size  # the chunk's tokens over the whole SP group
        positions_Bn = position_ids.to(query.device).expand(batch, n).contiguous()
        parts = []
        for local, dim in ((key.contiguous(), 2), (value.contiguous(), 2), (positions_Bn, 1)):
            gathered = [torch.empty_like(local) for _ in range(ring.size)]
            dist.all_gather(gathered, local, group=ring.group)
            parts.append(_ring_order(gathered, dim))
        key, value, chunk_positions_BC = parts
        store, start = self.store, self.m * span
        index_C = torch.arange(start, start + span, device=query.device)
        index_q = SequenceLayout(span, ring.size, 1, ring.size).ring_index(ring.rank, query.device) + start
        self.order.follow(chunk_positions_BC)
        self.gathered = True
        store.put(("idx", self.m), index_C.expand(batch, span), offload=False)
        store.put(("doc", self.m), index_C - chunk_positions_BC, offload=False)
        store.put(("q_idx", self.m), index_q.expand(batch, n), offload=False)
        store.put(("q_doc", self.m), index_q - positions_Bn, offload=False)
        return key, value

    def _gathered_start(self, n: int) -> int:
        """Global index of the first of chunk m's n tokens gathered over the SP group; DataError unless the local
        sequence is cut the way FPDT's layout cuts it (SPDataAdapter / shard_batch given the model's chunk setting)."""
        spec, chunks = self.spec, len(self.spec.bounds)
        a, b = spec.bounds[self.m]
        sp = n // (b - a)
        layout = sequence_layout(sp * spec.seq, sp, spec.owner.chunks) if n % (b - a) == 0 else None
        if layout is None or layout.length != sp * spec.seq or layout.chunks != chunks:
            raise DataError(_NOT_FPDT_ORDER.format(n=n, seq=spec.seq, chunks=chunks))
        self.gathered = True
        return layout.gathered_span(self.m)[0]


_NOT_FPDT_ORDER = (
    "chunked attention under sequence parallelism got {n} tokens for a chunk of a {seq}-token shard cut into {chunks} "
    "chunks: the batch is not laid out in FPDT's order for this chunk setting. Shard batches with SPDataAdapter or "
    "shard_batch given the model's chunk setting (chunks=MemoryPlan.attn_chunking)."
)


class _PositionOrder:
    """position_ids of one attention call's tokens, chunk after chunk in global order: every document after a row's
    first must start at position 0 (chunked attention tells documents apart by index - position; lstune's packing
    does this). Under SP this also catches a batch in contiguous shards, whose gathered chunks jump mid-document.
    Checked once per call (`check`), since reading the flag syncs the device."""

    def __init__(self) -> None:
        self.last_BS: Tensor | None = None
        self.bad: Tensor | None = None

    def follow(self, positions_BS: Tensor) -> None:
        from torch._subclasses.fake_tensor import is_fake

        if is_fake(positions_BS):
            return
        joined_BS = positions_BS if self.last_BS is None else torch.cat([self.last_BS, positions_BS], dim=1)
        bad = ((joined_BS[:, 1:] != joined_BS[:, :-1] + 1) & (joined_BS[:, 1:] != 0)).any()
        self.bad = bad if self.bad is None else self.bad | bad
        self.last_BS = positions_BS[:, -1:]

    def check(self, gathered: bool) -> None:
        bad, self.bad, self.last_BS = self.bad, None, None
        if bad is not None and bool(bad):
            raise DataError("chunked attention needs every packed document to start at position 0 (position_ids reset "
                            "to 0); these position_ids restart elsewhere. Fix the data, or use --attn-chunks off."
                            + (" Under sequence parallelism the batch must also be in FPDT's order: shard it with "
                               "SPDataAdapter or shard_batch given the model's chunk setting." if gathered else ""))


def _own(x: Tensor) -> Tensor:
    """`x`, or a copy of it when it is a view into a larger tensor: a fused projection's q, k and v (Phi-3's
    `qkv_proj`, GPT-2's `c_attn`) are views of its one output, and saving the view would keep that whole output
    alive on the device for the layer's backward."""
    if x.untyped_storage().nbytes() > x.numel() * x.element_size():
        return x.clone(memory_format=torch.contiguous_format)
    return x


# --------------------------------------------------------------------------------------------------------------------
# Layouts and the block kernel (pure PyTorch, fp32 scores)
# --------------------------------------------------------------------------------------------------------------------


def _to5(x_BHnD: Tensor, kv_heads: int) -> Tensor:
    """[B, H, n, D] → [B, H_kv, H/H_kv, n, D]: query head h uses kv head h // (H/H_kv) (HF's repeat_kv)."""
    batch, heads, n, dim = x_BHnD.shape
    return x_BHnD.reshape(batch, kv_heads, heads // kv_heads, n, dim)


def _out_layout(out5: Tensor) -> Tensor:
    """[B, H_kv, g, n, D] → [B, n, H, D] contiguous, as HF attention functions return."""
    batch, kv_heads, group, n, dim = out5.shape
    return out5.reshape(batch, kv_heads * group, n, dim).transpose(1, 2).contiguous()


def _chunk_forward(sink: _ChunkSink, query: Tensor, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
    """Chunk m's queries against the keys/values of the chunks they see (of chunks 0..m, k_m/v_m just stored),
    merged; records which chunks contributed and the kernel each block took (`sink.sources`). The reads are planned
    first, so each block's keys/values are fetched under the block before it, and the next chunk's first ones (a
    guess, `_next_first_block`) under this chunk's last block."""
    store, m, config = sink.store, sink.m, sink.config
    device = query.device
    q5 = _to5(query, config["kv_heads"])
    ids_q = _query_ids(store, m, device)
    ids = [(store.get(("idx", i), device), store.get(("doc", i), device)) for i in range(m + 1)]
    kinds = block_kinds(q5, key, value, ids_q, ids, config["window"], config["softcap"])
    if config["ring"] is not None:  # the zigzag pieces against their whole chunk: neither "same" nor "before" (they
        kinds[m] = MASKED           # are among the keys), and every row attends itself
    blocks = {i: kind for i, kind in enumerate(kinds) if kind is not None}
    sink.sources[m] = blocks
    units = [_Unit(() if i == m else (("k", i), ("v", i))) for i in blocks]
    if m + 1 < len(sink.spec.bounds):
        guess = _next_first_block(next(iter(blocks)), m, config["window"])
        units.append(_Unit((("k", guess), ("v", guess))))
    store.plan(units)
    acc_out = acc_lse = None
    for i, kind in blocks.items():
        store.next_unit(device)
        allowed = None
        if kind == MASKED:
            allowed = allowed_pairs(*ids_q, *ids[i], config["window"])
        k4, v4 = (key, value) if i == m else (store.get(("k", i), device), store.get(("v", i), device))
        out, lse = block_forward(kind, q5, k4, v4, allowed, config["scale"], config["softcap"])
        acc_out, acc_lse = merge(acc_out, acc_lse, out, lse)
    if config["sinks"] is not None:  # once, after the merge: the backward then runs on the sink-applied (o, lse)
        acc_out, acc_lse = apply_sinks(acc_out, acc_lse, config["sinks"])
    return acc_out.to(query.dtype), acc_lse


def _next_first_block(first: int, m: int, window: int | None) -> int:
    """The key chunk chunk m + 1 likely reads first, from chunk m's first (`first`): the same one without a sliding
    window (causal: chunk 0); with one, the next once the window has started sliding (it keeps its distance back).
    A wrong guess costs one late read; its copy is dropped when the next chunk plans."""
    return first + 1 if window is not None and 0 < first < m else first


# --------------------------------------------------------------------------------------------------------------------
# Saved chunks: on the device or in (pinned) host memory, read on a schedule
# --------------------------------------------------------------------------------------------------------------------

Key = tuple[str, int]  # (what, chunk): ("k", 3) is chunk 3's keys


@functools.cache
def _side_stream(kind: str, device: torch.device) -> torch.cuda.Stream:
    return torch.cuda.Stream(device=device)


@dataclass
class _Unit:
    """One compute unit of a pass (a block kernel, a module re-run) and the host items it reads. `short`: a module
    re-run or an elementwise step, too little compute to hide a block's reads under it."""

    reads: tuple[Key, ...]
    short: bool = False


class _ChunkStore:
    """Per-chunk tensors by key. With `offload`, `put` copies to host memory — pinned, on a side stream, on CUDA (a
    separate buffer on CPU, so the path runs in tests and traces) — and `get` brings them back on another side stream,
    the compute stream waiting only for the copy it needs, each copy waiting only for the host write of its own key.

    Reads follow a schedule (`plan`: the pass's compute units in order, with what each reads): `next_unit` starts
    the next unit's copies not yet started — late, their time exposed on CUDA — then those of the unit after it, and
    of the one after that when that one is short, so each read has at least one unit's compute to hide under (the
    copies of the next block's query chunk under the current block; the next key chunk's under the last block of
    the key chunk before and the projections' backward between them). `stats` counts the reads of each kind.
    Written by hand: torch's offload hooks (`torch.autograd.graph.save_on_cpu`) copy back on use, unprefetched."""

    def __init__(self, offload: bool, stats: ChunkStats):
        self.offload, self.stats = offload, stats
        self.items: dict[Key, Tensor | HostBlocks] = {}
        self.on_host: set[Key] = set()  # keys whose item is a host copy (HostBlocks)
        self._resident: dict[Key, Tensor] = {}  # device copies of host items kept for later reads (`get(keep=True)`)
        self._arriving: dict[Key, tuple[Tensor, Any]] = {}  # CUDA: device copy in flight, its event
        self._landed: dict[Key, Any] = {}  # CUDA: event after the key's device-to-host copy
        self._asked: dict[Key, int] = {}  # keys whose device copy is started: the unit it was started in
        self._units: list[_Unit] = []
        self._unit, self._tick = -1, 0  # index of the running unit in `_units`; units started so far

    def put(self, key: Key, tensor: Tensor, *, offload: bool = True) -> None:
        self._forget(key)
        if self.offload and offload:
            self.items[key] = self._to_host(key, tensor)
            self.on_host.add(key)
        else:
            self.items[key] = tensor
            self.on_host.discard(key)

    def packed(self) -> tuple[list[tuple], list[Tensor]]:
        """The items as `save_for_backward` takes them, tensors only (a host copy's blocks in order), and the layout
        `adopt` rebuilds them from: per key, its host copy's shape and dtype (None for a device item) and how many
        of the tensors are its own."""
        layout, tensors = [], []
        for key, item in self.items.items():
            parts = item.blocks if isinstance(item, HostBlocks) else [item]
            shape = (item.shape, item.dtype) if isinstance(item, HostBlocks) else None
            layout.append((key, shape, len(parts)))
            tensors += parts
        return layout, tensors

    def adopt(self, layout: list[tuple], tensors: list[Tensor], device: torch.device) -> None:
        """Backward: the items its forward saved (`packed`); their copies to the host were started on the side stream
        before now."""
        self.items, self.on_host, at = {}, set(), 0
        for key, shape, count in layout:
            parts, at = tensors[at:at + count], at + count
            if shape is None:
                self.items[key] = parts[0]
            else:
                self.items[key] = HostBlocks(*shape, pinned=device.type == "cuda", blocks=parts)
                self.on_host.add(key)
        if device.type == "cuda" and self.on_host:
            landed = torch.cuda.Event()
            landed.record(_side_stream("d2h", device))
            self._landed = dict.fromkeys(self.on_host, landed)

    def has(self, key: Key) -> bool:
        return key in self.items

    def _to_host(self, key: Key, tensor: Tensor) -> HostBlocks:
        """A host copy of `tensor`: pinned blocks on CUDA (memory.host_copies: no power-of-two rounding), written on
        the side stream; on CPU one block, read in place. Fake tensors (memory traces, on CPU) take the CPU path: a
        separate copy, counted in `stats`, which the trace moves from its device peak to the host."""
        self.stats.bytes_to_host += tensor.numel() * tensor.element_size()
        source = tensor.contiguous()
        host = HostBlocks(tensor.shape, tensor.dtype, pinned=tensor.is_cuda, split=tensor.is_cuda)
        if not tensor.is_cuda:
            host.write(source)
        else:
            self._landed[key] = host.from_device(source, _side_stream("d2h", tensor.device))
        self.stats.add(host)
        return host

    def plan(self, units: list[_Unit]) -> None:
        """The units to run next, in order; copies in flight that none of them reads (a guess that missed) go."""
        reads = {key for unit in units for key in unit.reads}
        for key in [k for k in self._asked if k not in reads]:
            self._arriving.pop(key, None)
            del self._asked[key]
        self._units, self._unit = units, -1

    def next_unit(self, device: torch.device) -> None:
        """The next unit of the plan starts: copies of its reads not started yet, then those of the units ahead."""
        self._unit += 1
        self._tick += 1
        own = self._units[self._unit].reads
        ahead = []
        for unit in self._units[self._unit + 1:self._unit + 3]:
            ahead += [key for key in unit.reads if key not in own]
            if not unit.short:
                break
        for key in (*own, *ahead):
            self.prefetch(key, device)

    def prefetch(self, key: Key, device: torch.device) -> None:
        """Start the device copy of host item `key` (nothing for items on the device, kept, in flight or not yet
        written). On CPU the item is read in place; the copy is only counted."""
        if key not in self.on_host or key in self._asked or key in self._resident:
            return
        self._asked[key] = self._tick
        host: HostBlocks = self.items[key]
        self.stats.bytes_from_host += host.shape.numel() * host.dtype.itemsize
        if device.type != "cuda":
            return
        self._arriving[key] = host.to_device(device, _side_stream("h2d", device), after=self._landed.get(key))

    def get(self, key: Key, device: torch.device, *, keep: bool = False) -> Tensor:
        """Item `key` on `device`: a host item through its device copy (started now if no earlier unit started it:
        a late read); `keep` holds that copy for the chunk's later reads (until `pop` or `drop_chunk`)."""
        if key in self._resident:
            return self._resident[key]
        if key not in self.on_host:
            return self.items[key]
        self.prefetch(key, device)
        late = self._asked.pop(key) >= self._tick
        self.stats.reads_late += late
        self.stats.reads_ahead += not late
        if key in self._arriving:
            tensor, ready = self._arriving.pop(key)
            torch.cuda.current_stream(device).wait_event(ready)
        else:  # on CPU: the one block, in place
            tensor = self.items[key].tensor()
        if keep:
            self._resident[key] = tensor
        return tensor

    def pop(self, key: Key, device: torch.device) -> Tensor:
        tensor = self.get(key, device)
        self._forget(key)
        del self.items[key]
        self.on_host.discard(key)
        return tensor

    def drop_chunk(self, m: int) -> None:
        for key in [k for k in self.items if k[1] == m]:
            self._forget(key)
            del self.items[key]
            self.on_host.discard(key)

    def _forget(self, key: Key) -> None:
        """Drop what the store holds for `key` besides its item: a kept or arriving device copy, its events."""
        for held in (self._resident, self._arriving, self._landed, self._asked):
            held.pop(key, None)


# --------------------------------------------------------------------------------------------------------------------
# The autograd Function
# --------------------------------------------------------------------------------------------------------------------


class _ChunkedAttentionFunction(torch.autograd.Function):
    """Forward chunk by chunk with no autograd graph; backward in FPDT's three phases (module doc)."""

    @staticmethod
    def forward(ctx, spec: _ChunkSpec, hidden_BSD: Tensor, *params: Tensor) -> Tensor:
        owner = spec.owner
        store = spec.sink.store = _ChunkStore(owner.offload, owner.stats)
        ctx.spec, ctx.params = spec, () if spec.into_grad else params
        ctx.autocast = _autocast_state(hidden_BSD.device.type)
        ctx.rng = []
        spec.sink.sources = {}
        # With attention saved (lstune.memory.attention_saved) the layer's first forward keeps the store beside its
        # checkpoint, and checkpoint's recompute runs the chunks on it with no attention kernel ("saved").
        saves = current_saves()
        ctx.entry, fresh = saves.next_entry() if saves is not None else (None, True)
        fresh = fresh or ctx.entry.chunks is None  # the first forward kept nothing (attention sinks): recomputed
        if not fresh:
            ctx.layout, saved, sources, spec.sink.config, spec.sink.gathered = ctx.entry.chunks
            store.adopt(ctx.layout, saved, hidden_BSD.device)
            store.plan([_Unit((("o", m),), short=True) for m in range(len(spec.bounds))])
        out_BSD = None
        for m, (a, b) in enumerate(spec.bounds):
            ctx.rng.append(_RngState.capture(hidden_BSD.device))
            if not fresh:
                store.next_unit(hidden_BSD.device)
            y_BcD = spec.run(hidden_BSD[:, a:b], m, "forward" if fresh else "saved")
            if m == 0:
                out_BSD = y_BcD.new_empty((y_BcD.shape[0], spec.seq, *y_BcD.shape[2:]))
            out_BSD[:, a:b].copy_(y_BcD)
        if fresh:
            spec.sink.order.check(spec.sink.gathered)
            sources = dict(spec.sink.sources)
            # Saved through save_for_backward (not held by ctx), so an enclosing checkpoint drops and recomputes them.
            ctx.layout, saved = store.packed()
            # Not with attention sinks (gpt-oss): saved attention does not combine with them; the layer recomputes.
            if ctx.entry is not None and spec.sink.config.get("sinks") is None:
                ctx.entry.chunks = (ctx.layout, saved, sources, dict(spec.sink.config), spec.sink.gathered)
        ctx.sources = sources
        ctx.save_for_backward(hidden_BSD, *saved)
        spec.sink.store = None
        return out_BSD

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_BSD: Tensor):
        spec: _ChunkSpec = ctx.spec
        hidden_BSD, *saved = ctx.saved_tensors
        if hidden_BSD.is_cuda and spec.owner.offload:
            torch.cuda.current_stream(hidden_BSD.device).wait_stream(_side_stream("d2h", hidden_BSD.device))
        store = spec.sink.store = _ChunkStore(spec.owner.offload, spec.owner.stats)
        store.adopt(ctx.layout, saved, hidden_BSD.device)
        del saved
        readers = _readers(ctx.sources, len(spec.bounds))
        store.plan(_backward_units(ctx.sources, readers))
        want_x = ctx.needs_input_grad[1]
        try:
            with _replay_autocast(ctx.autocast):
                _output_grads(spec, ctx.rng, hidden_BSD, grad_BSD)
                grad_x, param_grads = _attention_and_input_grads(spec, ctx, readers, hidden_BSD, grad_BSD, want_x)
        finally:
            spec.sink.store = None
        if ctx.entry is not None:
            LayerSaves.release(ctx.entry)
        if spec.into_grad:
            return (None, grad_x, None)
        return (None, grad_x, *[g if g is None else g.to(p.dtype) for g, p in zip(param_grads, ctx.params)])


# The backward's order (`_backward_units` lists it; the loops below run it): (a) and the rowsums from the last query
# chunk to the first; (b) key chunk i's blocks from the last query chunk to i itself, then (c) chunk i's projections.
# Last-to-first puts the diagonal block last, next to (c): its dq is final there and stays on the device for (c),
# and so does its merged output o_i (the flash kernels read it); the chunk written last in (a) is read last in (b).


def _reader_order(readers: dict[int, str]) -> list[int]:
    """Key chunk i's query chunks (j >= i, the diagonal among them) in the order (b) runs them: from the last."""
    return sorted(readers, reverse=True)


def _readers(sources: dict[int, dict[int, str]], chunks: int) -> dict[int, dict[int, str]]:
    """Key chunk i -> {query chunk j attending it: the block's kernel kind}, from the forward's sources."""
    return {i: {j: sources[j][i] for j in range(chunks) if i in sources[j]} for i in range(chunks)}


def _backward_units(sources: dict[int, dict[int, str]], readers: dict[int, dict[int, str]]) -> list[_Unit]:
    """The host reads of the backward, unit by unit, in the order the loops below run them (the comment above)."""
    last_first = range(len(readers) - 1, -1, -1)
    units = [_Unit((("o", m),), short=True) for m in last_first]
    units += [_Unit((("o", j), ("dout", j)), short=True) for j in last_first if MASKED in sources[j].values()]
    written: set[int] = set()  # query chunks whose dq accumulator the store holds
    for i, readers_i in readers.items():
        for n, j in enumerate(_reader_order(readers_i)):
            kv = (("k", i), ("v", i)) if n == 0 else ()
            dq = (("dq", j),) if j in written else ()
            units.append(_Unit((*kv, ("q", j), ("dout", j), ("lse", j), (_rows_key(readers_i[j]), j), *dq)))
            written.add(j)
        units.append(_Unit((("o", i),), short=True))
    return units


def _output_grads(spec: _ChunkSpec, rng: list, hidden_BSD: Tensor, grad_BSD: Tensor) -> None:
    """Phase (a): dO_m through the output projection (the attention output a leaf), and q_m, for every chunk."""
    sink, store = spec.sink, spec.sink.store
    for m in range(len(spec.bounds) - 1, -1, -1):
        a, b = spec.bounds[m]
        store.next_unit(hidden_BSD.device)
        with _replay_rng(rng[m], hidden_BSD.device), torch.enable_grad():
            y_BcD = spec.run(hidden_BSD[:, a:b].detach(), m, "replay")
            leaf = sink.leaf
            (dout,) = torch.autograd.grad(y_BcD, leaf, grad_BSD[:, a:b], allow_unused=True)
        dout = torch.zeros_like(leaf) if dout is None else dout
        sink.leaf = None
        store.put(("dout", m), _to5(dout.transpose(1, 2), sink.config["kv_heads"]))


def _attention_and_input_grads(spec: _ChunkSpec, ctx, readers: dict[int, dict[int, str]], hidden_BSD: Tensor,
                               grad_BSD: Tensor, want_x: bool):
    """Phases (b) and (c): FPDT's kv-outer / q-inner attention backward; after outer iteration i, chunk i's
    projections are backpropagated with (dOut_i, dq_i, dk_i, dv_i)."""
    sink, store, device = spec.sink, spec.sink.store, hidden_BSD.device
    chunks = len(spec.bounds)
    for j in range(chunks - 1, -1, -1):
        # The PyTorch kernel takes the rowsums; the flash ops recompute them from the output.
        if MASKED in ctx.sources[j].values():
            store.next_unit(device)
            o5, dout5 = store.get(("o", j), device), store.get(("dout", j), device)
            store.put(("delta", j), (dout5.float() * o5.float()).sum(-1))
    grad_x = torch.empty_like(hidden_BSD) if want_x else None
    param_grads: list[Tensor | None] = [None] * len(ctx.params)
    with _Zero3Readiness(spec.into_grad, frozenset()) as readiness:
        for i, readers_i in readers.items():
            # Queries see only chunks <= their own (under SP too, in FPDT's layout): after outer iteration i, dk_i,
            # dv_i and dq_i are complete.
            dk4, dv4 = _kv_chunk_backward(spec, i, readers_i, device)
            if sink.config["ring"] is not None:  # the gathered chunk's gradients, summed over the ring, home
                dk4, dv4 = (ring_reduce_scatter(d, sink.config["ring"]) for d in (dk4, dv4))
            readiness.set(last_tile=i == chunks - 1)
            store.next_unit(device)
            dqkv = (store.pop(("dq", i), device), dk4, dv4)
            del dk4, dv4
            grads = _projection_backward(spec, ctx, hidden_BSD, grad_BSD, i, dqkv, want_x)
            del dqkv
            if want_x:
                a, b = spec.bounds[i]
                grad_x[:, a:b].copy_(grads[0])
            _accumulate(param_grads, grads[1:])
            del grads  # else this chunk's weight gradients live on through the next chunk's backward
            store.drop_chunk(i)
    return grad_x, param_grads


def _kv_chunk_backward(spec: _ChunkSpec, i: int, readers: dict[int, str], device) -> tuple[Tensor, Tensor]:
    """Outer iteration i: dk_i, dv_i over the query chunks j >= i that attend it (`readers`: j -> the block's kind),
    the diagonal last; dq_j accumulated in the store (dq_i, final after the diagonal, on the device for phase (c))."""
    store, config = spec.sink.store, spec.sink.config
    ids_k = store.get(("idx", i), device), store.get(("doc", i), device)
    k4 = v4 = dk4 = dv4 = None
    for j in _reader_order(readers):
        store.next_unit(device)
        if k4 is None:
            k4, v4 = store.get(("k", i), device), store.get(("v", i), device)
            dk4 = torch.zeros(k4.shape, dtype=torch.float32, device=device)
            dv4 = torch.zeros(v4.shape, dtype=torch.float32, device=device)
        kind, allowed = readers[j], None
        if kind == MASKED:
            allowed = allowed_pairs(*_query_ids(store, j, device), *ids_k, config["window"])
        rows = _rows_key(kind)
        merged = store.get((rows, j), device, keep=j == i and rows == "o"), store.get(("lse", j), device)
        dq5, dk, dv = block_backward(kind, store.get(("q", j), device), k4, v4, store.get(("dout", j), device),
                                     merged, allowed, config["scale"], config["softcap"])
        dk4 += dk
        dv4 += dv
        if j == i and config["sinks"] is not None:
            spec.sink.sink_grads[i] = _sink_grad(rows, merged, store.get(("dout", j), device), config["sinks"])
        if store.has(("dq", j)):
            dq5 = dq5 + store.get(("dq", j), device)
        store.put(("dq", j), dq5, offload=j != i)
    return dk4, dv4


def _sink_grad(rows: str, merged: tuple[Tensor, Tensor], dout5: Tensor, sinks5: Tensor) -> Tensor:
    """Query chunk j's part of the sinks' gradient ([H]) from what its diagonal block read: the merged output or
    its rowsums, and the lse (`attention_sinks.sink_gradient`)."""
    first, lse = merged
    delta = rowsums(first, dout5) if rows == "o" else first
    return sink_gradient(lse, delta, sinks5).sum(dim=(0, 3)).reshape(-1)


def _query_ids(store: _ChunkStore, m: int, device) -> tuple[Tensor, Tensor]:
    """(global index, document key) of query chunk m's rows: the chunk's tokens, or under a ring this rank's two zigzag
    pieces of it (the keys' ids then cover the whole gathered chunk, `_ChunkSink._ring_chunk`)."""
    if store.has(("q_idx", m)):
        return store.get(("q_idx", m), device), store.get(("q_doc", m), device)
    return store.get(("idx", m), device), store.get(("doc", m), device)


def _ring_order(gathered: list[Tensor], dim: int) -> Tensor:
    """One chunk in global order from its ring positions' tokens along `dim` (`all_gather`'s list, position r holding
    the chunk's zigzag pieces r and 2R−1−r)."""
    ring = len(gathered)
    pieces: list = [None] * (2 * ring)
    for r, part in enumerate(gathered):
        pieces[r], pieces[2 * ring - 1 - r] = part.chunk(2, dim=dim)
    return torch.cat(pieces, dim=dim)


def ring_reduce_scatter(grad_BHCD: Tensor, ring: Any) -> Tensor:
    """The gradient of a gathered chunk ([B, H_kv, C, D], global order), summed over the ring's positions, each
    keeping its own tokens (pieces r and 2R−1−r): `_ring_order`'s all-gather, backwards. An all-to-all of each
    position's share (a reduce-scatter; gloo has none) and a sum."""
    import torch.distributed as dist

    pieces = grad_BHCD.chunk(2 * ring.size, dim=2)
    shares = [torch.cat([pieces[r], pieces[2 * ring.size - 1 - r]], dim=2) for r in range(ring.size)]
    received = torch.empty((ring.size, *shares[0].shape), dtype=grad_BHCD.dtype, device=grad_BHCD.device)
    dist.all_to_all_single(received, torch.stack(shares), group=ring.group)
    return received.sum(0)


def _rows_key(kind: str) -> str:
    """What a block's backward reads of its query chunk besides the lse: the rowsums (PyTorch kernel) or the merged
    output (flash kernels, which compute the rowsums themselves)."""
    return "delta" if kind == MASKED else "o"


def _projection_backward(spec, ctx, hidden_BSD, grad_BSD, i, dqkv, want_x) -> list[Tensor | None]:
    """Phase (c) for chunk i: re-run the module with grad; backpropagate the output gradient and dq/dk/dv into the
    chunk's input and the weights: [grad of the hidden slice, grad of each returned param]."""
    a, b = spec.bounds[i]
    x_BcD = hidden_BSD[:, a:b].detach().requires_grad_(want_x)
    with _replay_rng(ctx.rng[i], hidden_BSD.device), torch.enable_grad():
        y_BcD = spec.run(x_BcD, i, "backward")
    query, key, value, sinks = spec.sink.captured
    spec.sink.captured = ()
    pairs = [(y_BcD, grad_BSD[:, a:b])] + [
        (t, g.reshape(t.shape).to(t.dtype)) for t, g in zip((query, key, value), dqkv)
    ]
    if sinks is not None:
        pairs.append((sinks, spec.sink.sink_grads.pop(i).to(sinks.dtype)))
    pairs = [(t, g) for t, g in pairs if t.requires_grad]
    inputs = ([x_BcD] if want_x else []) + list(spec.into_grad or ctx.params)
    if not pairs:
        return [torch.zeros_like(x_BcD) if want_x else None] + [None] * len(ctx.params)
    outputs, grads = zip(*pairs)
    if spec.into_grad:
        torch.autograd.backward(outputs, grads, inputs=inputs)
        gx = x_BcD.grad if want_x else None
        return [gx if gx is not None or not want_x else torch.zeros_like(x_BcD)]
    found = list(torch.autograd.grad(outputs, inputs, grads, allow_unused=True))
    if not want_x:
        return [None, *found]
    return [found[0] if found[0] is not None else torch.zeros_like(x_BcD), *found[1:]]
