"""Feeding sequence-parallel ranks: each SP group works on one full sample at a time (ALST Sec. 4.2).

Every rank's DataLoader yields its own full-length batches (the shared contract: LongTensors `[B, S]`
`input_ids`, `position_ids`, `shift_labels`, labels already shifted on the FULL sequence — ALST 4.3, so
no shard loses its first target). `SPDataAdapter` turns the sp ranks' batches into sp micro-batches that
the whole group processes one after another: for micro-batch i, rank i pads its sample, cuts it into sp
shards along the sequence and scatters them. Rank r gets the contiguous tokens `[r·S/sp, (r+1)·S/sp)` of
rank i's sample — or, when chunked attention (`--attn-chunks`, FPDT) cuts the local sequence into M > 1
chunks, FPDT's pieces r, r+sp, …, r+(M-1)·sp of sp·M equal ones, so that the all-to-all of every rank's
chunk m is one contiguous stretch of the sample (lstune.models.chunk_layout) — or, under Ulysses × ring, the zigzag
layout (ring position r holds pieces r and 2R−1−r of 2R, cut among its Ulysses ranks). position_ids and labels travel
with their tokens (Ulysses gathers position_ids back inside attention), so packed-document boundaries,
rotary positions and the loss (a sum over tokens) are those of the unsharded sample.

Memory: each rank holds only its 1/sp shard of the sample being processed (plus its own full batch
while waiting to send it, as the DataLoader produced it). Cost: one scatter per tensor per sample — a
few bytes per token, negligible next to the model.

Padding: to a multiple of sp (of sp·M with FPDT's layout). The pad tokens get `shift_labels = -100`
(ignored by the loss) and position_ids continuing the last document, so they sit at the end of the causal
sequence (in the last pieces) where no real token attends to them: the loss and gradients are exactly those
of the unpadded sample.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable, Iterator

from lstune.data.batch import IGNORE_INDEX
from lstune.errors import DataError
from lstune.models.chunk_layout import AttentionChunks, SequenceLayout, sequence_layout

if TYPE_CHECKING:
    import torch

    from lstune.parallel.dims import ParallelDims

REQUIRED_KEYS = ("input_ids", "position_ids", "shift_labels")


def count_tokens(batch: dict[str, "torch.Tensor"]) -> int:
    """Tokens that carry a loss in `batch` (shift_labels ≠ -100)."""
    return int((batch["shift_labels"] != IGNORE_INDEX).sum())


def pad_to_multiple(batch: dict[str, "torch.Tensor"], multiple: int) -> dict[str, "torch.Tensor"]:
    """`batch` with its sequence padded to a multiple of `multiple` (ignored labels, continuing positions)."""
    import torch

    seq = batch["input_ids"].shape[1]
    pad = -seq % multiple
    if pad == 0:
        return batch
    out = {}
    for key, x in batch.items():
        if key == "position_ids":
            tail = x[:, -1:] + torch.arange(1, pad + 1, device=x.device, dtype=x.dtype)
        else:
            fill = IGNORE_INDEX if key == "shift_labels" else 0
            tail = torch.full((x.shape[0], pad), fill, dtype=x.dtype, device=x.device)
        out[key] = torch.cat([x, tail], dim=1)
    return out


def lay_out(batch: dict[str, "torch.Tensor"], sp: int, chunks: AttentionChunks | None,
            ring: int = 1) -> tuple[dict, SequenceLayout]:
    """`batch` padded for its layout on `sp` ranks with attention `chunks` (None: unchunked) and `ring` ring positions
    (zigzag), and the layout."""
    layout = sequence_layout(batch["input_ids"].shape[1], sp, chunks, ring)
    if ring > 1:
        check_document_starts(batch["position_ids"])
    return pad_to_multiple(batch, layout.length), layout


def check_document_starts(position_ids_BS: "torch.Tensor") -> None:
    """Ring attention tells documents apart by index − position (lstune.memory.attention_ring): each position must
    continue the one before by +1 or start a document at 0. DataError otherwise (checked on the whole sample, before
    it is cut)."""
    bad = (position_ids_BS[:, 1:] != position_ids_BS[:, :-1] + 1) & (position_ids_BS[:, 1:] != 0)
    if bool(bad.any()):
        raise DataError("ring attention (--sp-ring > 1) needs every packed document to start at position 0 "
                        "(position_ids reset to 0, as lstune's packing writes them); these restart elsewhere. Fix the "
                        "data, or use --sp-ring 1.")


def shard_batch(batch: dict[str, "torch.Tensor"], sp: int, sp_rank: int,
                chunks: AttentionChunks | None = None, ring: int = 1) -> dict[str, "torch.Tensor"]:
    """Rank `sp_rank`'s 1/sp sequence shard of `batch` (padded first if needed): contiguous, FPDT's pieces when
    `chunks` (the model's `--attn-chunks`) cut the local sequence into more than one chunk, or its zigzag pieces'
    share under a `ring` (lstune.models.chunk_layout)."""
    batch, layout = lay_out(batch, sp, chunks, ring)
    return {k: layout.shard(x, sp_rank).contiguous() for k, x in batch.items()}


def check_batch(batch: dict[str, Any]) -> None:
    """Raise DataError unless `batch` follows the shared contract (tensors `[B, S]`, the three keys)."""
    missing = [k for k in REQUIRED_KEYS if k not in batch]
    if missing:
        raise DataError(
            f"sequence parallelism needs {', '.join(REQUIRED_KEYS)} in every batch; missing {', '.join(missing)}. "
            "Labels must be shifted on the full sequence before sharding (lstune's data pipeline does this)."
        )
    shape = tuple(batch["input_ids"].shape)
    bad = [k for k, x in batch.items() if not hasattr(x, "shape") or tuple(x.shape) != shape]
    if bad:
        raise DataError(f"batch fields {', '.join(bad)} are not tensors shaped like input_ids {list(shape)}")


class SPDataAdapter:
    """Wraps each rank's DataLoader of full-length batches; yields this rank's shard of each SP micro-batch.

    Per round, each of the sp ranks contributes one batch from its loader and the adapter yields sp
    micro-batches (rank 0's sample, then rank 1's, …), each as this rank's sequence shard. Every rank of
    the group yields the same sample at the same step, so collectives inside the model line up. The
    wrapped loaders must yield different data per rank (e.g. a sampler over all world ranks); when any
    rank of the group runs out, the whole group stops. Only the contract's three fields travel (others
    are dropped). With sp == 1 batches pass through unchanged. `chunks`: the model's chunked attention
    (`MemoryPlan.attn_chunking`); with more than one chunk per rank the shards are FPDT's pieces, which is
    what chunked attention under SP expects (it refuses contiguous shards it can tell apart).
    """

    def __init__(self, loader: Iterable, dims: "ParallelDims", device: Any = "cpu", *,
                 chunks: AttentionChunks | None = None):
        self.loader = loader
        self.dims = dims
        self.device = device
        self.chunks = chunks

    def __len__(self) -> int:
        return len(self.loader) * self.dims.sp  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[dict[str, "torch.Tensor"]]:
        if self.dims.sp == 1:
            yield from self.loader
            return
        batches, group = iter(self.loader), self.dims.sp_comm
        while True:
            # Each rank reads and checks its own batch: a refusal on one is every rank's (its message), before the
            # gather below would wait for it.
            batch = group.agreed(lambda: self._next_laid_out(batches))
            shapes = self._gather_shapes(batch)
            if any(b == 0 for b, _ in shapes):
                return
            for src, shape in enumerate(shapes):
                yield self._receive(batch if src == self.dims.sp_rank else None, src, shape)

    def _next_laid_out(self, batches: Iterator) -> dict[str, "torch.Tensor"] | None:
        """This rank's next batch, checked and laid out on this rank's device; None when its loader has ended."""
        batch = next(batches, None)
        if batch is None:
            return None
        check_batch(batch)
        batch, _ = lay_out({k: v.to(self.device) for k, v in batch.items()}, self.dims.sp, self.chunks, self.dims.ring)
        return batch

    def _gather_shapes(self, batch) -> list[tuple[int, int]]:
        """(batch size, padded length) of each SP rank's batch; (0, 0) for a rank whose loader ended."""
        import torch
        import torch.distributed as dist

        mine = torch.tensor(tuple(batch["input_ids"].shape) if batch is not None else (0, 0), device=self.device)
        shapes = [torch.empty_like(mine) for _ in range(self.dims.sp)]
        dist.all_gather(shapes, mine, group=self.dims.sp_group)
        return [tuple(s.tolist()) for s in shapes]

    def _receive(self, batch, src: int, shape: tuple[int, int]) -> dict[str, "torch.Tensor"]:
        """This rank's shard of SP rank `src`'s batch (which `src` passes as `batch`, the others as None)."""
        import torch
        import torch.distributed as dist

        sp = self.dims.sp
        b, seq = shape
        # `seq` is laid out already: the same layout on every rank
        layout = sequence_layout(seq, sp, self.chunks, self.dims.ring)
        src_global = self.dims.sp_group_ranks(self.dims.dp_rank)[src]
        shard = {}
        for key in REQUIRED_KEYS:
            out = torch.empty((b, layout.local), dtype=torch.long, device=self.device)
            shards = None
            if batch is not None:
                shards = [layout.shard(batch[key].long(), r).contiguous() for r in range(sp)]
            dist.scatter(out, shards, src=src_global, group=self.dims.sp_group)
            shard[key] = out
        return shard
