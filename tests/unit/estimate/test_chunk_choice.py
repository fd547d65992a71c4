"""`--attn-chunks auto` (the default) is the estimate's choice (issue 14, FPDT): off while the run fits without,
else the fewest chunks that fit — one MemoryChoice that `lstune estimate` shows and `lstune train` applies.
Llama-3.1-8B LoRA on one H100 80 GB with a 128 GiB host; chunks are no shorter than 16K tokens there, the shortest
whose host copies hide under their attention at the H100's rates. Mini-sequence off (its `auto` comes before
chunks and would fit 512K alone: tests/unit/estimate/test_mini_sequence_choice.py)."""

from __future__ import annotations

import pytest

from lstune.config.schema import TrainConfig
from lstune.estimate import estimate, step_flops
from lstune.estimate.hardware import resolve_hardware
from lstune.models.presets import preset_config

GiB = 2**30
K = 1024


def _estimate(seq_len: int, **flat):
    config = TrainConfig.from_flat({"model": "llama-3.1-8b", "seq_len": seq_len, "lora_r": 16,
                                    "offload_checkpoints": True, "mini_sequence": False, **flat})
    return estimate(config, resolve_hardware(gpu="h100-80gb", host_mem=128 * GiB), suggest=False)


@pytest.fixture(scope="module")
def long_run():
    """512K tokens: does not fit unchunked (the attention block's full-sequence tensors), fits in 4 chunks."""
    return _estimate(512 * K)


def test_auto_is_the_default_and_stays_off_while_the_run_fits_without():
    assert TrainConfig().memory.attn_chunks == "auto"
    e = _estimate(128 * K)
    assert e.fits and e.memory_choice.attn_chunks == "off"
    assert "chunks" not in e.memory_choice.describe()


def test_auto_takes_the_fewest_chunks_that_fit(long_run):
    choice = long_run.memory_choice
    assert long_run.fits and choice.attn_chunks == 4
    assert "attention in 4 chunks: the fewest that fit" in choice.describe()
    assert not _estimate(512 * K, attn_chunks="off").fits
    assert not _estimate(512 * K, attn_chunks=2).fits
    assert choice.applied_to(TrainConfig.from_flat({"seq_len": 512 * K})).memory.attn_chunks == 4


def test_chunking_reaches_longer_sequences_than_off(long_run):
    off = _estimate(512 * K, attn_chunks="off")
    assert long_run.longest_seq_len > off.longest_seq_len >= 256 * K


def test_the_users_setting_wins():
    assert _estimate(128 * K, attn_chunks=8).memory_choice.attn_chunks == 8
    assert _estimate(512 * K, attn_chunks="off").memory_choice.attn_chunks == "off"


def test_chunks_cost_two_more_forwards_of_the_attention_projections(long_run):
    """FPDT's per-token parts run per chunk in forward, again to replay the output gradient and once more to
    backpropagate: 2 × (q, k, v, o) forward FLOPs (and their adapters) more, nothing else."""
    config = preset_config("llama-3.1-8b")
    kwargs = dict(lora=True, checkpointing=True, lora_r=16)
    plain = step_flops(config, 8192, **kwargs)
    chunked = step_flops(config, 8192, attn_chunked=True, **kwargs)
    h, q, kv, layers, tokens = 4096, 4096, 1024, 32, 8192
    projections = 2 * h * (2 * q + 2 * kv) * tokens * layers
    adapters = 2 * 16 * ((h + q) + 2 * (h + kv) + (q + h)) * tokens * layers
    assert chunked.hardware - plain.hardware == pytest.approx(2 * (projections + adapters), rel=1e-12)
    assert chunked.model == plain.model
    assert long_run.flops.hardware > _estimate(512 * K, attn_chunks="off").flops.hardware


def test_json_names_the_choice(long_run):
    assert long_run.to_dict()["memory_choice"]["attn_chunks"] == 4


def test_chunks_shorter_than_the_hiding_length_pay_for_their_copies():
    """At 128K tokens on an H100 (50 GB/s host link, 500 TFLOP/s attention) 32K-token chunks' host copies hide under
    their attention; 4K-token chunks (32) copy ~4× more and the step pays the difference."""
    from lstune.memory.attention_chunks import offload_copy_bytes

    hidden, short = (_estimate(128 * K, attn_chunks=n) for n in (4, 32))
    assert hidden.copies.exposed_seconds == 0 and short.copies.exposed_seconds > 5
    out, into = offload_copy_bytes(128 * K, 32, 4096, 1024, 32, element_size=2, forward_runs=2, flash=True)
    assert (short.copies.chunk_out_bytes, short.copies.chunk_in_bytes) == (32 * out, 32 * into)
    attention = short.flops.hardware_attention / 500e12
    assert short.copies.exposed_seconds == pytest.approx(32 * into / 50e9 - attention)
    assert short.step_seconds - hidden.step_seconds == pytest.approx(short.copies.exposed_seconds, rel=1e-9)
    assert short.to_dict()["host_copies"]["chunk_in_bytes"] == 32 * into
    # The checkpoints' copies (out and back, 31 layers on the host) are counted, not timed: they hide (MEMO Eq. 1).
    assert hidden.copies.checkpoint_bytes == 2 * hidden.breakdown.placement.host_bytes() > 0


def _chunk_host_bytes(seq_len: int, chunks: int, gpu: str) -> tuple[int, int]:
    """(the estimate's host bytes of the live layer's offloaded chunks, the same copies' exact bytes)."""
    config = TrainConfig.from_flat({"model": "llama-3.1-8b", "seq_len": seq_len, "lora_r": 16,
                                    "offload_checkpoints": True, "mini_sequence": False, "attn_chunks": chunks})
    e = estimate(config, resolve_hardware(gpu=gpu, host_mem=128 * GiB), suggest=False)
    (held,) = [item.host for item in e.breakdown.items if item.name.startswith("attention chunks on the host")]
    c = seq_len // chunks
    # Per chunk: k, v (1024 wide), output (4096), lse (32 heads, fp32); q, dO (4096), rowsums (fp32), dq (fp32 4096),
    # in bf16 on CUDA, fp32 on CPU.
    b = 4 if gpu == "cpu" else 2
    per_token = b * 1024 + b * 1024 + b * 4096 + 4 * 32 + b * 4096 + b * 4096 + 4 * 32 + 4 * 4096
    return held, seq_len * per_token + c * 8 * 1024


def test_offloaded_chunks_are_pinned_in_pieces_so_only_a_small_remainder_is_rounded():
    """On CUDA each chunk copy is pinned in power-of-two pieces (memory.host_copies), so torch's caching host
    allocator, which rounds every allocation up to a power of two, rounds only a copy's last piece under 1 MiB:
    96K-token chunks (768K in 8) hold exactly their bytes (each copy rounded whole: a third more — what an emulated
    768K run was killed for, 2026-11-26), 16,400-token ones (keys of 32 MiB + 32 KiB: whole, 64 MiB) under 1 MiB a
    copy more; on CPU the copies are exact. The estimate's host total, and the checkpoints it places beside them,
    follow."""
    held, exact = _chunk_host_bytes(768 * K, 8, "h100-80gb")
    assert held == exact
    held, exact = _chunk_host_bytes(8 * 16_400, 8, "h100-80gb")
    assert exact <= held < exact + 8 * 8 * 2**20
    held, exact = _chunk_host_bytes(768 * K, 8, "cpu")
    assert held == exact


def test_under_a_ring_each_chunk_holds_the_gathered_keys_and_auto_may_choose_chunks():
    """Chunked attention under Ulysses 4 × ring 2 (issue 35): each chunk's k and v are the whole chunk's, all-gathered
    over the ring (lstune.memory.attention_chunks), so the host holds R times a rank's k/v (and one gathered chunk's
    fp32 dk/dv); the query-side items stay a rank's. `auto` may then choose chunks under a ring."""
    seq, sp, ring, chunks = 1024 * K, 8, 2, 4
    flat = {"model": "llama-3.1-8b", "seq_len": seq, "lora_r": 16, "offload_checkpoints": True, "mini_sequence": False,
            "gpus": sp, "sp": sp, "sp_ring": ring}
    hardware = resolve_hardware(gpu="cpu", host_mem=1024 * GiB, gpus=sp)
    e = estimate(TrainConfig.from_flat({**flat, "attn_chunks": chunks}), hardware, suggest=False)
    (held,) = [item.host for item in e.breakdown.items if item.name.startswith("attention chunks on the host")]
    t = seq // sp
    per_token = 4 * 1024 * ring * 2 + 4 * 4096 + 4 * 32 + 4 * 4096 * 2 + 4 * 32 + 4 * 4096
    assert held == t * per_token + t // chunks * 8 * 1024 * ring
    from lstune.estimate.choice import chunk_options
    from lstune.estimate.shapes import ModelShape

    options = chunk_options(TrainConfig.from_flat(flat), hardware, ModelShape.from_config(preset_config("llama-3.1-8b")),
                            sp)
    assert options[0] == "off" and len(options) > 1 and all(isinstance(n, int) and n > 1 for n in options[1:])
