"""Host copies of device tensors, held in blocks: what the checkpoint offloader and chunked attention's store keep in
(pinned, on CUDA) host memory, and the host bytes they take.

Torch's pinned-memory caching allocator (`CachingHostAllocator`) rounds every request up to a power of two and keeps
the block cached: one 4.1 GiB checkpoint (Llama-3.1-8B at ~270K tokens) would pin 8 GiB, one 768 MiB chunk output
(96K tokens) 1 GiB, and a 16,400-token chunk's keys (32.03 MiB) 64 MiB. A host copy is therefore held in pieces whose
sizes are powers of two, which the allocator does not round: blocks of `HOST_BLOCK_BYTES`, then the remainder's
binary digits down to `MIN_PIECE_BYTES` (31.875 MiB → 16 + 8 + 4 + 2 + 1 MiB and 0.875 MiB), so only the last piece,
under 1 MiB, is rounded. 64 MiB copies run at full PCIe bandwidth, and 1 MiB ones take ~20-40 µs against a launch of
~10 µs. Written by hand: torch offers no pinned allocation that is not rounded.

The byte arithmetic needs no torch (`lstune estimate` counts these bytes without importing it); `HostBlocks`
imports it where it allocates.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterator

if TYPE_CHECKING:
    import torch

HOST_BLOCK_BYTES = 64 << 20
MIN_PIECE_BYTES = 1 << 20  # a remainder's last piece, under this, is not split further (module doc)


def host_block_sizes(numel: int, element_size: int) -> list[int]:
    """Element counts of the pieces that hold `numel` elements (module doc): full blocks, the remainder's powers of
    two from half a block down to MIN_PIECE_BYTES, then what is left. Element sizes are powers of two, so each piece
    but the last is a power of two in bytes."""
    per_block = max(1, HOST_BLOCK_BYTES // element_size)
    full, rest = divmod(numel, per_block)
    sizes = [per_block] * full
    piece = HOST_BLOCK_BYTES // 2
    while piece >= max(MIN_PIECE_BYTES, element_size):
        if rest * element_size >= piece:
            sizes.append(piece // element_size)
            rest -= piece // element_size
        piece //= 2
    return sizes + ([rest] if rest else [])


def pinned_bytes(nbytes: int, pinned: bool) -> int:
    """Host bytes one allocation of `nbytes` takes: pinned ones rounded up to a power of two by torch's caching host
    allocator (`CachingHostAllocator`: `PowerOf2Ceil`), others exact."""
    return 1 << (nbytes - 1).bit_length() if pinned and nbytes > 0 else nbytes


def host_copy_bytes(numel: int, element_size: int, *, pinned: bool) -> int:
    """Host bytes a copy's pieces (`host_block_sizes`) really take: pinned, each rounded up to a power of two (only
    the last, under MIN_PIECE_BYTES, grows); unpinned, exact. The full blocks counted, not listed: the estimate asks
    this of copies of any size (a terabyte is 16K blocks)."""
    per_block = max(1, HOST_BLOCK_BYTES // element_size)
    full, rest = divmod(numel, per_block)
    pieces = host_block_sizes(rest, element_size)  # the remainder's: a few
    return full * pinned_bytes(per_block * element_size, pinned) + sum(
        pinned_bytes(n * element_size, pinned) for n in pieces)


class HostBlocks:
    """A tensor's copy in host memory: `blocks`, flat, sized by `host_block_sizes`, pinned when `pinned`;
    `split=False` holds it in one block (unpinned memory is not rounded, and one block is read in place).
    `blocks` given: the copy those blocks already hold (rebuilt after autograd kept them for backward)."""

    def __init__(self, shape: "torch.Size", dtype: "torch.dtype", *, pinned: bool, split: bool = True,
                 blocks: "list[torch.Tensor] | None" = None):
        import torch  # the one place this module needs it (module doc)

        self.shape, self.dtype = torch.Size(shape), dtype
        numel = self.shape.numel()
        if blocks is None:
            sizes = host_block_sizes(numel, dtype.itemsize) if split else [numel]
            blocks = [torch.empty(n, dtype=dtype, pin_memory=pinned) for n in sizes]
        self.blocks = list(blocks)
        self.nbytes = sum(pinned_bytes(block.numel() * dtype.itemsize, pinned) for block in self.blocks)

    def pieces(self, flat: "torch.Tensor") -> Iterator[tuple["torch.Tensor", "torch.Tensor"]]:
        """(host block, the slice of the flat tensor it holds), in order."""
        start = 0
        for block in self.blocks:
            yield block, flat[start : start + block.numel()]
            start += block.numel()

    def write(self, source: "torch.Tensor", *, non_blocking: bool = False) -> None:
        """Copy `source` (contiguous, of `shape`) into the blocks; on CUDA `non_blocking` enqueues on the current
        stream."""
        for block, piece in self.pieces(source.view(-1)):
            block.copy_(piece, non_blocking=non_blocking)

    def read_into(self, target: "torch.Tensor", *, non_blocking: bool = False) -> None:
        """Copy the blocks into `target` (contiguous, of `shape`)."""
        for block, piece in self.pieces(target.view(-1)):
            piece.copy_(block, non_blocking=non_blocking)

    def from_device(self, source: "torch.Tensor", stream: "torch.cuda.Stream") -> "torch.cuda.Event":
        """Start the copy of CUDA tensor `source` (contiguous, of `shape`) into these (pinned) blocks on side
        `stream`, after the compute work enqueued so far (which made `source`); returns the event of its landing.
        `source` is marked as used by `stream`, so the allocator does not hand its memory out before the copy is
        done. The one device-to-host copy of both offloads (checkpoints, attention chunks); `to_device` is the way
        back."""
        import torch

        stream.wait_stream(torch.cuda.current_stream(source.device))
        with torch.cuda.stream(stream):
            self.write(source, non_blocking=True)
            landed = torch.cuda.Event()
            landed.record(stream)
        source.record_stream(stream)
        return landed

    def to_device(self, device: "torch.device", stream: "torch.cuda.Stream", *,
                  after: "torch.cuda.Event | None" = None) -> "tuple[torch.Tensor, torch.cuda.Event]":
        """Start the copy onto CUDA `device` on side `stream` (after `after`, the event of the copy's own write):
        (the device tensor, the event of its arrival, for the compute stream to wait on before it reads it).
        The device tensor comes from the compute stream's pool, where it is read and freed: allocated on the side
        stream, each block went back to that stream's cache, which compute allocations cannot reuse (a likely part of
        the 34 GiB the 2026-11-26 H200 run reserved for 12.7 GiB allocated). So the copy also waits for the compute
        work enqueued so far (the block may have served it). The checkpoint offloader's prefetch and the chunk
        store's scheduled reads both start here."""
        import torch

        compute = torch.cuda.current_stream(device)
        target = torch.empty(self.shape, dtype=self.dtype, device=device)
        stream.wait_stream(compute)
        if after is not None:
            stream.wait_event(after)
        with torch.cuda.stream(stream):
            self.read_into(target, non_blocking=True)
            arrived = torch.cuda.Event()
            arrived.record(stream)
        target.record_stream(stream)
        return target, arrived

    def tensor(self) -> "torch.Tensor":
        """The copy as one host tensor of `shape`: the block itself when there is one (no copy), else gathered."""
        if len(self.blocks) == 1:
            return self.blocks[0].view(self.shape)
        import torch

        whole = torch.empty(self.shape, dtype=self.dtype)
        self.read_into(whole)
        return whole


def reserve_pinned(copies: "list[tuple[int, torch.dtype]]") -> int:
    """Pin every piece (`host_block_sizes`) of these host copies of (numel, dtype) at once, then free them: torch's
    caching host allocator keeps the pinned blocks, so a run's first step finds them cached instead of pinning each
    copy on the fly (`cudaHostAlloc`, which made first steps 32-73 % slower than the steady state on an H100 at
    8K-64K, issue 33). Returns the bytes pinned. The blocks stay with torch's allocator (reused, not held twice)."""
    import torch

    blocks = [torch.empty(n, dtype=dtype, pin_memory=True)
              for numel, dtype in copies for n in host_block_sizes(numel, dtype.itemsize)]
    total = sum(pinned_bytes(b.numel() * b.element_size(), True) for b in blocks)
    del blocks
    return total
