"""How chunked attention (FPDT, `--attn-chunks`) cuts a sequence, and where a sample's tokens sit on the ranks of a
Ulysses SP group. The SP data adapter (lstune.parallel.sp_data) lays samples out with `sequence_layout` and the
attention sink (lstune.memory.attention_chunks) reads the gathered chunks with the same function, so the two cannot
disagree.

FPDT's layout (paper 003 Sec. 4): with P ranks and M chunks per rank, the padded sample is cut into P·M equal pieces
of c tokens and rank r holds pieces r, r + P, …, r + (M-1)·P, in that order. Local chunk m of rank r is piece
m·P + r, so the all-to-all of chunk m gathers pieces m·P … m·P + P - 1: the contiguous global span
[m·P·c, (m+1)·P·c). Chunk m's queries then see the keys of chunks <= m only, as without SP. With one chunk (or
sp 1) nothing is reordered: rank r holds the contiguous shard [r·S/P, (r+1)·S/P).

Padding: a sample is padded (ignored labels, continuing positions — `sp_data.pad_to_multiple`) to a multiple of P·M,
M taken for the unpadded local length ceil(S/P); at most P·M - 1 pad tokens, all at the end of the global sequence
(the last pieces), where no real token attends to them. For `auto` (chunks of at most `auto_tokens`) M = ceil(local
/ auto_tokens) and the chunks are local/M long — never padded up to a multiple of P·auto_tokens.

Ring attention's zigzag layout (`ring` R > 1, lstune.parallel.ring; the SP group is R ring positions × U = P/R Ulysses
ranks): the padded sample is cut into 2R equal pieces and ring position r holds pieces r and 2R−1−r, in that order —
every ring position then holds an early and a late stretch, so under causality each does the same attention work.
Those 2 pieces are the ring position's own sequence, cut into U contiguous shards for its Ulysses ranks (SP rank
r·U + u holds shard u), so the Ulysses all-to-all of the U ranks gathers exactly the ring position's two pieces.
Padding: to a multiple of 2·P (at most 2·P − 1 pad tokens, at the end: in piece 2R−1, on ring position 0's second
piece, where no real token attends to them).

Chunked attention under a ring (chunk-major): the padded sample (a multiple of M·2·P) is cut into M chunks and the
zigzag applies inside each — ring position r holds pieces r and 2R−1−r of every chunk, cut among its U Ulysses
ranks; a rank's local chunk m is its share of chunk m, so the Ulysses all-to-all of local chunk m gathers the ring
position's two pieces of chunk m, and the chunk sink all-gathers the rest of chunk m over the ring
(lstune.memory.attention_chunks). M is taken for the unpadded local length, as without a ring.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import Tensor


@dataclass(frozen=True)
class AttentionChunks:
    """`--attn-chunks` as the code runs it: "off", "auto" (chunks of at most `auto_tokens`; off up to that length,
    `memory.attention_chunks.auto_chunk_tokens` gives it) or a chunk count."""

    setting: str | int = "off"
    auto_tokens: int | None = None
    ring: int = 1  # the run's ring part (--sp-ring): where set up (probes), its chunks hold the zigzag inside each

    def __post_init__(self) -> None:
        if self.setting == "auto" and not self.auto_tokens:
            raise ValueError("--attn-chunks auto needs the chunk length (auto_chunk_tokens of the model's widths)")

    def count(self, seq_len: int) -> int:
        """Chunks a local sequence of `seq_len` tokens is cut into (1 = unchunked; never more than its tokens)."""
        if self.setting == "off":
            return 1
        wanted = math.ceil(seq_len / self.auto_tokens) if self.setting == "auto" else int(self.setting)
        return max(1, min(wanted, seq_len))

    def describe(self) -> str:
        return f"chunks of {self.auto_tokens} tokens" if self.setting == "auto" else f"{self.setting} chunks"


@dataclass(frozen=True)
class SequenceLayout:
    """Where the tokens of one padded sample of `length` tokens sit on `sp` ranks, each holding `chunks` attention
    chunks: FPDT's pieces when `reordered` (sp > 1 and chunks > 1), contiguous shards otherwise; under a `ring` the
    zigzag inside each chunk (module doc)."""

    length: int
    sp: int
    chunks: int
    ring: int = 1

    def __post_init__(self) -> None:
        if self.ring > 1 and self.sp % self.ring:
            raise ValueError(f"a ring of {self.ring} needs an SP degree it divides (sp {self.sp})")
        per_chunk = 2 * self.sp if self.ring > 1 else max(1, self.sp)
        multiple = per_chunk * (self.chunks if self.sp > 1 else 1)
        if self.length % multiple:
            raise ValueError(f"{self.length} tokens do not cut into {self.sp} × {self.chunks} equal pieces")

    @property
    def reordered(self) -> bool:
        return self.sp > 1 and self.chunks > 1

    @property
    def local(self) -> int:
        """Tokens per rank."""
        return self.length // self.sp

    @property
    def ulysses(self) -> int:
        """Ulysses ranks per ring position."""
        return self.sp // self.ring

    def ring_pieces(self, ring_rank: int) -> tuple[int, int]:
        """The two of the 2R pieces ring position `ring_rank` holds (zigzag)."""
        return ring_rank, 2 * self.ring - 1 - ring_rank

    def ring_index(self, ring_rank: int, device=None) -> Tensor:
        """Global token indices [length / ring] of ring position `ring_rank`'s sequence (its two pieces)."""
        import torch

        piece = self.length // (2 * self.ring)
        return torch.cat([torch.arange(p * piece, (p + 1) * piece, device=device) for p in self.ring_pieces(ring_rank)])

    def shard(self, x_BS: Tensor, rank: int) -> Tensor:
        """Rank `rank`'s tokens of `x_BS` ([B, length], global order), in local order."""
        if self.ring > 1:
            ring_rank, u = divmod(rank, self.ulysses)
            pieces = x_BS.unflatten(1, (self.chunks, 2 * self.ring, -1))
            mine = pieces[:, :, list(self.ring_pieces(ring_rank))].flatten(2)
            return mine.unflatten(2, (self.ulysses, -1))[:, :, u].flatten(1)
        groups = self.chunks if self.reordered else 1
        return x_BS.unflatten(1, (groups, self.sp, -1))[:, :, rank].flatten(1)

    def unshard(self, shards: list[Tensor], dim: int = 0) -> Tensor:
        """The whole sequence, in global order, from every rank's tokens (`shard`'s inverse along `dim`)."""
        import torch

        if self.ring > 1:
            per_rank = [shard.chunk(self.chunks, dim=dim) for shard in shards]
            order = []
            for m in range(self.chunks):
                pieces = [None] * (2 * self.ring)
                for ring_rank in range(self.ring):
                    ranks = range(ring_rank * self.ulysses, (ring_rank + 1) * self.ulysses)
                    own = torch.cat([per_rank[rank][m] for rank in ranks], dim=dim)
                    first, second = self.ring_pieces(ring_rank)
                    pieces[first], pieces[second] = own.chunk(2, dim=dim)
                order += pieces
            return torch.cat(order, dim=dim)
        groups = self.chunks if self.reordered else 1
        pieces = [piece for shard in shards for piece in shard.chunk(groups, dim=dim)]
        return torch.cat([pieces[rank * groups + m] for m in range(groups) for rank in range(self.sp)], dim=dim)

    def gathered_span(self, m: int) -> tuple[int, int]:
        """The global tokens [start, stop) of chunk m gathered over the SP group (the Ulysses all-to-all of every
        rank's local chunk m, in rank order): contiguous only when reordered."""
        if not self.reordered:
            raise ValueError("contiguous shards gather no contiguous chunk")
        span = self.length // self.chunks
        return m * span, (m + 1) * span


def sequence_layout(seq_len: int, sp: int, chunks: AttentionChunks | None, ring: int = 1) -> SequenceLayout:
    """The layout of a sample of `seq_len` tokens on `sp` ranks with `chunks` (None: unchunked), `ring` of them ring
    positions (zigzag, inside each chunk), padded as the module doc says. `seq_len` may already be padded: an already
    laid-out length maps to itself."""
    local = math.ceil(seq_len / sp)
    count = chunks.count(local) if chunks is not None and sp > 1 else 1
    multiple = count * (2 * sp if ring > 1 else sp)
    layout = SequenceLayout(math.ceil(seq_len / multiple) * multiple, sp, count, ring)
    # Padding never changes the chunk count (local <= M·c keeps ceil(local / M) <= c; under a ring c is rounded up to
    # an even count, which an even `auto_tokens` bounds alike), so the attention side, which sees only the padded
    # local length, finds the same M.
    if count > 1 and chunks.count(layout.local) != count:
        raise ValueError(f"{seq_len} tokens on {sp} ranks (ring {ring}) pad to {layout.local} per rank, which "
                         f"{chunks.describe()} cuts into {chunks.count(layout.local)} chunks, not {count}")
    return layout
