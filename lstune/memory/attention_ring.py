"""Ring attention (METP, paper 002 Sec. 3.4, Algs. 3-4; the inner loop): the second sequence-parallel dimension.

Each of the R ranks of a ring group keeps its own query tokens; the keys/values travel. Rank r holds ring position r's
two zigzag pieces (lstune.models.chunk_layout: pieces r and 2R−1−r of 2R, so causal work is balanced) — under Ulysses ×
ring after the Ulysses all-to-all, for its heads. Forward, hop h = 0..R−1: the K/V block of ring position r−h
(GQA-compressed: kv heads only, plus its tokens' document keys) comes point to point from its owner (every rank sends
its own block h positions ahead, `rotation.Ring.exchange`) while the hop before it computes — double buffering; each
(query piece, key piece) block runs `attention_blocks.block_forward` and is merged with `attention_blocks.merge` in
fp32 — the same kernels and the same online-softmax merge as chunked attention (`attention_chunks`), one merge for ring
hops and chunks. Causality, packed-document boundaries and sliding windows come from global token indices (the
layout) and document keys (index − position_id); blocks are cut to at most BLOCK_TOKENS a side (a bounded mask and score
tiles for the PyTorch kernel); a block with no allowed pair is skipped (`block_kinds`), and a hop
none of whose pieces a window reaches is neither sent nor computed (`ring_hops`: with a window shorter than a piece,
hops 0, 1 and R−1 only). Softcapping is the block kernel's score map. Learned attention sinks (gpt-oss; under Ulysses ×
ring the slice of the rank's q heads, which Ulysses cuts, uneven plans included) are applied once per query row after
every hop is merged (`models.attention_sinks.apply_sinks`, the function chunked and block attention use): the ring
keeps the sink-applied (O', lse').

Backward (`_RingFunction`): the same hops fetch the same blocks; each hop's dK/dV (FlashAttention's backward with the
queries' merged output and lse — with sinks, the sink-applied ones: exactly the gradient of the merge and the sinks) goes straight back to the block's owner while the
next hop computes, and the owner sums what comes home. dQ stays local, and so does the sinks' gradient from this rank's
query rows (`sink_gradient`; summed over ranks with the other weights' gradients). Sending each block from its owner rather than
relaying it rank to rank moves the same bytes per hop (one block per rank) and lets a window skip hops.

Memory per rank (S tokens in the group, R ring ranks, h_q / h_kv widths of the local heads): q, k, v, o of S/R tokens
(saved), plus two K/V blocks of S/R tokens (the one computed and the one arriving) and in backward two fp32 dK/dV
pairs — O(S/R), never the whole sequence. Score tiles are those of the block kernels. Communication per layer and
step: forward (H−1)·S/R·2·h_kv elements per rank; backward as much again plus the same in fp32 gradients.
Composes with: Ulysses (inside the ring, over each position's heads), activation checkpointing (the recompute
rotates again, in the same order on every rank), tiled MLP / loss (per token), LoRA and ZeRO (weights are outside).
Chunked attention (FPDT, `--attn-chunks`) under a ring: called inside a chunk, this kernel runs no hops — it hands
the call to the chunk sink with its ring group, which all-gathers the chunk's K/V over the ring
(lstune.memory.attention_chunks, the chunk-major zigzag layout of lstune.models.chunk_layout; docs/parallel.md).
Attention dropout is refused.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from lstune.errors import DataError, ModelError
from lstune.memory.rotation import Ring, wait
from lstune.memory.attention_blocks import MASKED, allowed_pairs, block_backward, block_forward, block_kinds, merge
from lstune.models.attention import chunk_positions, chunk_sink, record_attention_module, window_from_mask
from lstune.models.attention_sinks import apply_sinks, grouped_sinks, rowsums, sink_gradient
from lstune.models.chunk_layout import SequenceLayout

if TYPE_CHECKING:
    from torch import Tensor


def ring_hops(ring: int, piece: int, window: int | None) -> list[int]:
    """The hops every rank of a ring of `ring` positions runs (the same on all): each h for which some position's
    queries may attend the keys of position r − h, from the zigzag pieces of `piece` tokens — every h without a
    window; with one shorter than the sequence, the hops whose pieces all lie outside it are skipped (no compute, no
    send)."""
    needed = []
    for h in range(ring):
        for r in range(ring):
            src = (r - h) % ring
            pairs = [(pq, pk) for pq in (r, 2 * ring - 1 - r) for pk in (src, 2 * ring - 1 - src) if pk <= pq]
            if any(window is None or (pq - pk) * piece - (piece - 1) < window or pq == pk for pq, pk in pairs):
                needed.append(h)
                break
    return needed


@dataclass
class RingAttention:
    """The attention kernel under a ring (HF attention signature on the ring position's tokens): what Ulysses runs
    as its core (`apply_ulysses(core=...)`), or alone when the Ulysses part is 1. `ring`: the ring group's positions
    and peers (lstune.memory.rotation)."""

    ring: Ring
    # Runs a check of this rank's tokens so that every rank of the SP group ends alike, the refusing rank's message on
    # all (lstune.parallel.comm.Communicator.agreed); None: the check alone (one process, tests).
    agreed: Any = None
    _checked: Any = field(default=None, repr=False)  # the position_ids last found in zigzag order (once per forward)

    @classmethod
    def of(cls, dims: Any) -> "RingAttention":
        """From a ParallelDims with groups built (lstune.parallel.dims)."""
        peers = tuple(dims.ring_group_ranks(dims.dp_rank, dims.ulysses_rank))
        return cls(Ring(dims.ring, dims.ring_rank, peers, dims.ring_group), dims.sp_comm.agreed)

    def __call__(self, module, query, key, value, attention_mask, *, position_ids=None, scaling=None,
                 sliding_window=None, softcap=None, dropout=0.0, s_aux=None, is_causal=None, **_unused):
        record_attention_module(module)
        if dropout:
            raise ModelError(f"ring attention has no attention dropout (got {dropout}); set attention_dropout=0 in "
                             "the model config or use --sp-ring 1.")
        if not (is_causal if is_causal is not None else getattr(module, "is_causal", True)):
            raise ModelError(f"{type(module).__name__} attends bidirectionally; ring attention is causal only.")
        if position_ids is None:
            raise ModelError("ring attention needs position_ids at every attention call (documents and positions "
                             "come from them); this model does not pass them to attention: use --sp-ring 1.")
        window = window_from_mask(attention_mask, position_ids, sliding_window, query.shape[2], query.device,
                                  self.agreed)
        chunk = getattr(attention_mask, "chunk", None)  # the model's chunked attention (Llama-4): each chunk a document
        sink = chunk_sink()
        if sink is not None:  # chunked attention (FPDT) runs this module on one chunk: its sink gathers the chunk
            positions = chunk_positions(position_ids, chunk) if chunk else position_ids
            out_BnHD = sink(query, key, value, position_ids=positions, scaling=scaling, sliding_window=window,
                            softcap=softcap, dropout=dropout, sinks=s_aux, ring=self.ring)
            return out_BnHD, None
        self._check_zigzag(position_ids)
        if chunk:
            position_ids = chunk_positions(position_ids, chunk)
        batch, heads, n, dim = query.shape
        kv_heads = key.shape[1]
        layout = SequenceLayout(n * self.ring.size, self.ring.size, 1, self.ring.size)
        index_n = layout.ring_index(self.ring.rank, query.device)
        doc_Bn = index_n - position_ids.to(query.device).expand(batch, n)
        scale = scaling if scaling is not None else dim ** -0.5
        q5 = query.reshape(batch, kv_heads, heads // kv_heads, n, dim)
        if s_aux is not None and s_aux.shape != (heads,):
            raise ModelError(f"attention sinks of shape {tuple(s_aux.shape)} for {heads} query heads; expected "
                             f"[{heads}].")
        out5 = _RingFunction.apply(self.ring, q5, key, value, doc_Bn.contiguous(), (scale, window, softcap), s_aux)
        return out5.reshape(batch, heads, n, out5.shape[-1]).transpose(1, 2).contiguous(), None


    def _check_zigzag(self, positions_Bn: Tensor) -> None:
        """DataError unless the ring's tokens are in the zigzag layout with documents starting at position 0: inside
        each piece a position continues the one before by +1 or is 0, and a piece starting at position p > 0
        continues the piece before it in the sample (whose last position, gathered over the ring, is p − 1). Catches
        a batch sharded contiguously (the adapter not told of the ring). Once per forward: every layer passes the same
        position_ids. Only where gradients are on — a training step (its recompute, under checkpointing): the setup's
        probes (lstune.memory.probe) run the same few tokens on every rank under no_grad, no sample's shards."""
        import torch.distributed as dist
        from torch._subclasses.fake_tensor import is_fake

        if positions_Bn is self._checked or is_fake(positions_Bn) or not torch.is_grad_enabled():
            return  # checked already; a memory trace (no values); a probe or an evaluation (no_grad)
        pieces = _pieces(positions_Bn, 1)
        bad = any(((p[:, 1:] != p[:, :-1] + 1) & (p[:, 1:] != 0)).any() for p in pieces)
        ends = torch.stack([torch.stack([p[:, 0], p[:, -1]], 1) for p in pieces], 1)  # [B, 2 pieces, first / last]
        if self.ring.size > 1:
            gathered = [torch.empty_like(ends) for _ in range(self.ring.size)]
            dist.all_gather(gathered, ends.contiguous(), group=self.ring.group)
        else:
            gathered = [ends]
        by_piece = [None] * (2 * self.ring.size)  # global piece order
        for r, e in enumerate(gathered):
            by_piece[r], by_piece[2 * self.ring.size - 1 - r] = e[:, 0], e[:, 1]
        for before, piece in zip(by_piece, by_piece[1:]):
            bad = bad or bool(((piece[:, 0] != 0) & (piece[:, 0] != before[:, 1] + 1)).any())

        def check() -> None:  # `bad` from the gathered ends is alike on every rank; from this rank's pieces, not
            if bad:
                raise DataError("ring attention got position_ids out of its zigzag order (or a packed document not "
                                "starting at position 0): shard batches with SPDataAdapter / shard_batch given the "
                                "ring (ParallelDims.ring), and restart each document's positions at 0.")

        if self.agreed is not None:
            self.agreed(check)
        else:
            check()
        self._checked = positions_Bn


def _pieces(x: Tensor, dim: int) -> tuple[Tensor, Tensor]:
    """The two zigzag pieces of a ring position's tokens along `dim`."""
    return tuple(x.chunk(2, dim=dim))


# A block's tokens on each side, at most: the PyTorch block kernel's bool mask of a (query, key) block is t·s bytes
# (64 MiB here) and its score tiles grow with s — a whole zigzag piece (S/2R: 256K tokens at 4M on a ring of 8)
# would need 64 GiB of mask. The flash kernel's blocks need no mask; they are cut alike (one code path).
BLOCK_TOKENS = 8192


def _blocks_of(x: Tensor, dim: int) -> list[Tensor]:
    """A ring position's tokens along `dim` in blocks: each zigzag piece cut into equal parts of at most
    BLOCK_TOKENS (never across the two pieces, whose global indices jump)."""
    parts = -(-x.shape[dim] // 2 // BLOCK_TOKENS)
    return [block for piece in _pieces(x, dim) for block in torch.tensor_split(piece, parts, dim=dim)]


class _RingFunction(torch.autograd.Function):
    """Forward and backward of ring attention (module doc); q5 [B, Hkv, g, n, D], k4/v4 [B, Hkv, n, D], doc [B, n],
    sinks [Hkv·g] or None.

    Hop h's block comes straight from its owner, position r − h (`Ring.exchange(to=h)`: every rank sends its own block
    h ahead), fetched while the hop before it computes; a hop the window skips is neither fetched nor computed. In
    backward each hop's dK/dV go straight back to the block's owner while the next hop computes."""

    @staticmethod
    def forward(ctx, ring: Ring, q5: Tensor, k4: Tensor, v4: Tensor, doc_Bn: Tensor, config: tuple,
                sinks: Tensor | None):
        scale, window, softcap = config
        n = q5.shape[3]
        hops = ring_hops(ring.size, n // 2, window)
        index = SequenceLayout(n * ring.size, ring.size, 1, ring.size).ring_index
        ids_q = _ids(index(ring.rank, q5.device), doc_Bn)
        q_pieces = _blocks_of(q5, 3)
        acc = [(None, None)] * len(q_pieces)
        kinds_by_hop = []
        own = [k4.contiguous(), v4.contiguous(), doc_Bn]
        for hop, block in _blocks(ring, own, hops):
            k_blk, v_blk, doc_blk = block
            ids_k = _ids(index(ring.source(hop), q5.device), doc_blk)
            k_pieces, v_pieces = _blocks_of(k_blk, 2), _blocks_of(v_blk, 2)
            hop_kinds = []
            for j in range(len(q_pieces)):
                kinds = block_kinds(q_pieces[j], k_blk, v_blk, ids_q[j], list(ids_k), window, softcap)
                hop_kinds.append(kinds)
                for i, kind in enumerate(kinds):
                    if kind is None:
                        continue
                    allowed = allowed_pairs(*ids_q[j], *ids_k[i], window) if kind == MASKED else None
                    out, lse = block_forward(kind, q_pieces[j], k_pieces[i], v_pieces[i], allowed, scale, softcap)
                    acc[j] = merge(*acc[j], out, lse)
            kinds_by_hop.append(hop_kinds)
        out5, lse = torch.cat([a[0] for a in acc], dim=3), torch.cat([a[1] for a in acc], dim=3)
        if sinks is not None:  # once per row, after every hop: the backward runs on the sink-applied (O', lse')
            out5, lse = apply_sinks(out5, lse, grouped_sinks(sinks, k4.shape[1]))
        out5 = out5.to(q5.dtype)
        ctx.ring, ctx.config, ctx.hops, ctx.kinds = ring, config, hops, kinds_by_hop
        ctx.save_for_backward(q5, k4, v4, doc_Bn, out5, lse, sinks)
        return out5

    @staticmethod
    def backward(ctx, dout5: Tensor):
        ring, (scale, window, softcap), hops = ctx.ring, ctx.config, ctx.hops
        q5, k4, v4, doc_Bn, out5, lse, sinks = ctx.saved_tensors
        n = q5.shape[3]
        index = SequenceLayout(n * ring.size, ring.size, 1, ring.size).ring_index
        ids_q = _ids(index(ring.rank, q5.device), doc_Bn)
        dout5 = dout5.contiguous()
        delta = rowsums(out5, dout5)
        q_pieces, dout_pieces = _blocks_of(q5, 3), _blocks_of(dout5, 3)
        merged_o, merged_delta, merged_lse = _blocks_of(out5, 3), _blocks_of(delta, 3), _blocks_of(lse, 3)
        dq = [torch.zeros(p.shape, dtype=torch.float32, device=q5.device) for p in q_pieces]
        own = [k4.contiguous(), v4.contiguous(), doc_Bn]
        dk_own = torch.zeros(k4.shape, dtype=torch.float32, device=q5.device)
        dv_own = torch.zeros(v4.shape, dtype=torch.float32, device=q5.device)
        returning: list = []  # (requests, received dK, received dV) of the hop whose gradients are on their way home
        for step, (hop, block) in enumerate(_blocks(ring, own, hops)):
            k_blk, v_blk, doc_blk = block
            ids_k = _ids(index(ring.source(hop), q5.device), doc_blk)
            k_pieces, v_pieces = _blocks_of(k_blk, 2), _blocks_of(v_blk, 2)
            dk = dk_own if hop == 0 else torch.zeros(k_blk.shape, dtype=torch.float32, device=q5.device)
            dv = dv_own if hop == 0 else torch.zeros(v_blk.shape, dtype=torch.float32, device=q5.device)
            dk_pieces, dv_pieces = _blocks_of(dk, 2), _blocks_of(dv, 2)
            for j in range(len(q_pieces)):
                for i, kind in enumerate(ctx.kinds[step][j]):
                    if kind is None:
                        continue
                    allowed, merged = None, (merged_o[j], merged_lse[j])
                    if kind == MASKED:
                        allowed = allowed_pairs(*ids_q[j], *ids_k[i], window)
                        merged = (merged_delta[j], merged_lse[j])
                    dq_ji, dk_ji, dv_ji = block_backward(kind, q_pieces[j], k_pieces[i], v_pieces[i], dout_pieces[j],
                                                         merged, allowed, scale, softcap)
                    dq[j] += dq_ji
                    dk_pieces[i].add_(dk_ji)
                    dv_pieces[i].add_(dv_ji)
            _arrived(returning, dk_own, dv_own)  # the previous hop's share, sent home during this hop's compute
            if hop:  # back to the owner, position r − hop; position r + hop's share of this rank's block arrives
                home = [torch.empty_like(dk), torch.empty_like(dv)]
                returning.append((ring.exchange([dk, dv], home, to=-hop), *home))
        _arrived(returning, dk_own, dv_own)
        dq5 = torch.cat(dq, dim=3).to(q5.dtype)
        dsinks = None
        if sinks is not None and ctx.needs_input_grad[6]:  # this rank's query rows' part; the ranks' parts are summed
            per_row = sink_gradient(lse, delta, grouped_sinks(sinks, k4.shape[1]))
            dsinks = per_row.sum(dim=(0, 3)).reshape(sinks.shape).to(sinks.dtype)
        return None, dq5, dk_own.to(k4.dtype), dv_own.to(v4.dtype), None, None, dsinks


def _arrived(returning: list, dk_own: Tensor, dv_own: Tensor) -> None:
    """Wait for the gradients on their way home (at most one hop's: O(S/R) memory) and add them to this rank's."""
    while returning:
        requests, dk, dv = returning.pop()
        wait(requests)
        dk_own += dk
        dv_own += dv


def _blocks(ring: Ring, own: list[Tensor], hops: list[int]):
    """(hop, K/V block of position r − hop) for each hop, in order; the next hop's block is on its way while the caller
    computes the current one (double buffering)."""
    def fetch(hop):
        incoming = [torch.empty_like(t) for t in own]
        return incoming, ring.exchange(own, incoming, to=hop)

    pending = fetch(hops[0]) if hops[0] else None
    for at, hop in enumerate(hops):
        if hop == 0:
            block = own
        else:
            block, requests = pending
            wait(requests)
        pending = fetch(hops[at + 1]) if at + 1 < len(hops) else None
        yield hop, block


def _ids(index_n: Tensor, doc_Bn: Tensor) -> list[tuple[Tensor, Tensor]]:
    """(global index, document key) [B, block] of each of a position's blocks (`_blocks_of`)."""
    index_Bn = index_n.expand_as(doc_Bn)
    return list(zip(_blocks_of(index_Bn, 1), _blocks_of(doc_Bn, 1)))
