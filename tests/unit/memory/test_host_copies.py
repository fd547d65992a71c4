"""Host copies in power-of-two pieces (lstune.memory.host_copies): what torch's pinned allocator would round, the
bytes the estimate counts for them, and the copy itself, written and read back exactly."""

from __future__ import annotations

import pytest
import torch

from lstune.memory.host_copies import (
    HOST_BLOCK_BYTES,
    MIN_PIECE_BYTES,
    HostBlocks,
    host_block_sizes,
    host_copy_bytes,
    pinned_bytes,
)

MiB = 2**20


def _is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


@pytest.mark.parametrize("numel,element_size", [
    (270_000 * 4096, 2),  # Llama-3.1-8B's checkpoint at 270K tokens: 2.06 GiB, whole pinned 4 GiB
    (16_400 * 1024, 2),  # a 16,400-token chunk's keys: 32.03 MiB, whole pinned 64 MiB
    (16_320 * 1024, 2),  # a 16,320-token chunk's keys: 31.875 MiB, whole pinned 32 MiB
    (98_304 * 32, 4),  # a 96K-token chunk's log-sum-exp: 12 MiB, whole pinned 16 MiB
    (3, 4), (HOST_BLOCK_BYTES // 2, 2), (0, 2), (123_456_789, 8),
])
def test_pieces_are_powers_of_two_but_the_last_small_one(numel, element_size):
    sizes = host_block_sizes(numel, element_size)
    assert sum(sizes) == numel
    nbytes = [n * element_size for n in sizes]
    assert all(_is_power_of_two(n) and MIN_PIECE_BYTES <= n <= HOST_BLOCK_BYTES for n in nbytes[:-1])
    assert not nbytes or _is_power_of_two(nbytes[-1]) or nbytes[-1] < MIN_PIECE_BYTES
    held = host_copy_bytes(numel, element_size, pinned=True)
    assert held == sum(pinned_bytes(n, True) for n in nbytes)  # what the allocator hands out, piece by piece
    assert numel * element_size <= held < numel * element_size + MIN_PIECE_BYTES
    assert host_copy_bytes(numel, element_size, pinned=False) == numel * element_size


def test_a_copy_whole_would_pin_up_to_twice_its_size():
    keys = 16_400 * 1024 * 2  # a 16,400-token chunk's keys: 32 MiB + 32 KiB
    assert pinned_bytes(keys, True) == 64 * MiB
    assert host_copy_bytes(keys // 2, 2, pinned=True) == keys  # 32 MiB and 32 KiB: both powers of two
    output = 98_304 * 4096 * 2  # a 96K-token chunk's output: 768 MiB, whole 1 GiB
    assert pinned_bytes(output, True) == 1024 * MiB and host_copy_bytes(output // 2, 2, pinned=True) == output
    keys = 16_320 * 1024 * 2  # 31.875 MiB: whole 32 MiB; in pieces 16 + 8 + 4 + 2 + 1 MiB and 0.875 → 1 MiB
    assert pinned_bytes(keys, True) == 32 * MiB and host_copy_bytes(keys // 2, 2, pinned=True) == keys + 128 * 1024


@pytest.mark.parametrize("split", [True, False])
def test_a_host_copy_reads_back_exactly(monkeypatch, split):
    from lstune.memory import host_copies

    monkeypatch.setattr(host_copies, "HOST_BLOCK_BYTES", 4 * MiB)
    monkeypatch.setattr(host_copies, "MIN_PIECE_BYTES", 256 * 1024)
    source = torch.randn(2, 1_278_077)  # 9.75 MiB + 1000 B of fp32
    host = HostBlocks(source.shape, source.dtype, pinned=False, split=split)
    pieces = [4 * MiB, 4 * MiB, MiB, 512 * 1024, 256 * 1024, 1000] if split else [source.numel() * 4]
    assert [b.numel() * 4 for b in host.blocks] == pieces
    host.write(source)
    assert host.nbytes == source.numel() * 4
    assert torch.equal(host.tensor(), source)
    back = torch.empty_like(source)
    host.read_into(back)
    assert torch.equal(back, source)
    rebuilt = HostBlocks(source.shape, source.dtype, pinned=False, blocks=host.blocks)  # after save_for_backward
    assert torch.equal(rebuilt.tensor(), source) and rebuilt.nbytes == host.nbytes
