"""The arithmetic of the two host offloads — checkpoints (lstune.memory.checkpoint) and chunked attention's saved
chunks (lstune.memory.attention_chunks) — with no torch: `lstune estimate` sizes and chooses both without importing
it (an estimate stays a second or two). The modules that run the offloads import these from here.
"""

from __future__ import annotations

import math
from functools import lru_cache, partial

from lstune.memory.host_copies import host_copy_bytes
from lstune.memory.placement import CheckpointPlacement, plan_placement
from lstune.models.chunk_layout import AttentionChunks

# Offload threshold constants (MEMO Eq. 1). Not measured here (no GPU on the development machine):
# 25 GB/s is what pinned D2H copies reach on PCIe Gen4 x16 (Gen5 hosts reach ~50 GB/s, making this
# conservative); 400 TFLOP/s is bf16 dense matmul throughput a training step sustains on an H100
# (about 40 % of its 989 TFLOP/s peak).
PCIE_BYTES_PER_S = 25e9
SUSTAINED_FLOPS = 400e12
# Pinned copies below ~1 MiB are dominated by their fixed ~10 us launch/sync cost.
MIN_COPY_BYTES = 1 << 20


# offload_min_tokens of a layer whose linear compute never hides its checkpoint's copy (no attention to grow with S)
NEVER_HIDES = 1 << 40


def offload_min_tokens(
    layer_flop_params: int,
    hidden_size: int,
    attention_width: int,
    bytes_per_element: int = 2,
    *,
    pcie_bytes_per_s: float = PCIE_BYTES_PER_S,
    flops_per_s: float = SUSTAINED_FLOPS,
) -> int:
    """The shortest local sequence at which copying one layer's checkpoint hides under its forward.

    MEMO Eq. 1 with alpha = 0 (only the layer input is offloaded):
        copy time  S · D · b / BW  <=  layer forward  (2 · P · S + 2 · S² · A) / F
    where P is the parameters one token multiplies (MoE: active experts only) and A the attention
    width (heads · head_dim; causal attention costs 2 · S² · A FLOPs). Solving for S:
        S >= (D · b · F / BW - 2 · P) / (2 · A)
    plus a floor so each copy is at least `MIN_COPY_BYTES`. With F/BW = 16000 FLOP/B and bf16:
    Llama-3.1-8B (D 4096, P 218M) → 129 tokens (the floor: its layers hide the copy at any length);
    Llama-3.2-1B → 257 (floor); Qwen3-0.6B (D 1024, P 15.7M) → 513 (floor; Eq. 1 alone: 322);
    tiny-llama (D 128, P 185K) → 14,559 (Eq. 1: a thin layer computes too little to hide its copy).
    """
    linear_bound = (hidden_size * bytes_per_element * flops_per_s / pcie_bytes_per_s - 2 * layer_flop_params)
    if not attention_width:  # no attention (a pure state-space model): no S² term; linear compute hides it or never
        eq1 = 0.0 if linear_bound <= 0 else float(NEVER_HIDES)
    else:
        eq1 = max(0.0, linear_bound / (2 * attention_width))
    floor = MIN_COPY_BYTES / (hidden_size * bytes_per_element)
    return int(max(eq1, floor)) + 1


def auto_chunk_tokens(q_width: int, kv_width: int, *, pcie_bytes_per_s: float = PCIE_BYTES_PER_S,
                      flops_per_s: float = SUSTAINED_FLOPS, bytes_per_element: int = 2) -> int:
    """`--attn-chunks auto`'s chunk length where the estimate does not choose the count (lstune.estimate.choose_memory
    does for train): the shortest whose host copies hide under the attention they serve (FPDT), from the constants
    of the checkpoint offload threshold (lstune.memory.checkpoint). Two bounds, c tokens a chunk, b bytes an element,
    F/BW the compute rate over the copy bandwidth:
    - forward, block (m, i): fetch chunk i's k and v (c · 2 · h_kv · b bytes) under c queries against its c keys
      (4 · c² · h_q FLOPs, QKᵀ and PV): c >= h_kv · b · F / (2 · h_q · BW);
    - backward, inner iteration (j, i): fetch q_j, dO_j and the merged output o_j (3 · c · h_q · b: the flash
      kernel's backward recomputes the rowsums from o_j; the PyTorch kernel reads them instead, less) and read and
      write the fp32 dq_j accumulator (8 · c · h_q; lse_j, 4 · c · heads, is under 1% of it and left out) under
      FlashAttention's backward of the block (2.5 × the forward: 10 · c² · h_q FLOPs): c >= (3 · b + 8) · F / (10 · BW).
    The backward bound is the larger whenever h_kv <= h_q in bf16: with F/BW = 16000 FLOP/B, 22,400 tokens → 32,768
    after rounding up to a power of two, for every model (a PCIe Gen5 host, 50 GB/s: 16,384). A chunk's k copy is
    at least MIN_COPY_BYTES. FPDT measured a ~64K-token sweet spot for its kernels."""
    forward = kv_width * bytes_per_element * flops_per_s / (2 * q_width * pcie_bytes_per_s)
    backward = (3 * bytes_per_element + 8) * flops_per_s / (10 * pcie_bytes_per_s)
    floor = MIN_COPY_BYTES / (kv_width * bytes_per_element)
    return 1 << math.ceil(math.log2(max(forward, backward, floor, 1)))


def offload_copy_bytes(tokens: int, chunks: int, q_width: int, kv_width: int, heads: int, element_size: int,
                       forward_runs: int = 1, flash: bool = False) -> tuple[int, int]:
    """(device→host, host→device) bytes one layer's chunked attention copies in one step when its saved chunks live
    on the host (`_ChunkStore` with offload), for `tokens` local tokens (batch × sequence) in `chunks` equal chunks
    of c tokens, P = M(M+1)/2 (query, key) blocks, activations of `element_size` bytes (fp32 lse, delta, dq, dk,
    dv). Under Ulysses pass the local tokens and the full widths: a rank's gathered chunk has SP times the tokens
    and 1/SP of the heads. `forward_runs`: 2 when checkpointing re-runs the forward in backward. `flash`: every
    block takes the flash kernel (`attention_blocks.block_kind`: one document, no window cut, no softcap, a probed
    kernel), else the PyTorch kernel.
    - forward, per run: out k, v, o and lse of every chunk; in the keys/values of earlier chunks, (P - M) · c;
    - backward (a): in o, out q and dO; for the PyTorch kernel the rowsums: in o and dO, out delta; (b) per key chunk
      in k, v, per block in q, dO, lse, delta (flash: the output o instead, its kernel recomputes the rowsums) and
      (after the first key chunk) the fp32 dq accumulator, out dq but for the diagonal block's (the last of its key
      chunk: dq_i is final and stays on the device for (c)); (c) the PyTorch kernel's in o once more (the module's
      re-run; the flash kernels' diagonal block kept it on the device). dk and dv stay on the device: chunk i's
      projections run right after outer iteration i.
    `tests/unit/memory/test_attention_chunks.py` checks the store's copies against this."""
    if chunks <= 1:
        return 0, 0
    b, S, M = element_size, tokens, chunks
    c, blocks = tokens / chunks, chunks * (chunks + 1) // 2
    lse = 4 * S * heads
    rowsums_out, rowsums_in = (0, 0) if flash else (lse, 2 * S * q_width * b)
    per_block_rows = q_width * b if flash else 4 * heads  # o, or delta
    forward_out = S * (2 * kv_width + q_width) * b + lse
    forward_in = (blocks - M) * c * 2 * kv_width * b
    backward_out = 2 * S * q_width * b + rowsums_out + (blocks - M) * c * 4 * q_width
    backward_in = ((1 if flash else 2) * S * q_width * b + rowsums_in + M * c * 2 * kv_width * b
                   + blocks * c * (2 * q_width * b + 4 * heads + per_block_rows) + (blocks - M) * c * 4 * q_width)
    return (int(forward_runs * forward_out + backward_out), int(forward_runs * forward_in + backward_in))


def chunk_count(setting: str | int, seq_len: int, auto_tokens: int) -> int:
    """Chunks one (local) sequence of `seq_len` tokens is cut into (1 = unchunked): `len(chunk_bounds(...))`, counted
    without listing the bounds (the estimate asks this of absurd lengths too, and must answer at once)."""
    step = math.ceil(seq_len / AttentionChunks(setting, auto_tokens).count(seq_len))
    return math.ceil(seq_len / step)


def place_checkpoints(n_layers: int, checkpoint_bytes: int, *, tokens: int, layer_matmul_params: int,
                      attention_width: int, element_size: int, on_cuda: bool, host_budget: int | None,
                      device_budget: int | None) -> CheckpointPlacement:
    """`plan_placement` with the inputs both `lstune train` (lstune.memory.apply, from the model) and `lstune
    estimate` (lstune.estimate.placement, from the config's shapes) give it, computed here once: on CUDA the copy
    rate (PCIe) and one layer's forward time at `tokens` (its matmuls and causal attention at a sustained rate),
    whose ratio is the fraction of a checkpoint whose copy hides (MEMO Eq. 1); host bytes in pinned power-of-two
    pieces on CUDA (lstune.memory.host_copies; lstune.memory.placement.plan_placement). `host_budget` 0: nothing on the host (no offload)."""
    forward_s = None
    if on_cuda:
        flops = 2 * layer_matmul_params * tokens + 2 * tokens**2 * attention_width
        forward_s = flops / SUSTAINED_FLOPS

    host_bytes_of = partial(_pinned_copy_bytes, element_size, on_cuda)
    return plan_placement(
        n_layers, checkpoint_bytes, host_budget=host_budget, device_budget=device_budget,
        copy_bytes_per_s=PCIE_BYTES_PER_S if on_cuda else None, layer_forward_s=forward_s,
        host_bytes_of=host_bytes_of, tokens=tokens,
    )


@lru_cache(maxsize=1 << 16)  # the estimate's placement searches ask ~100,000 times for a few thousand sizes
def _pinned_copy_bytes(element_size: int, pinned: bool, nbytes: int) -> int:
    return host_copy_bytes(nbytes // element_size, element_size, pinned=pinned)


def forget_sizes() -> None:
    """Drop the remembered host sizes (an estimate starts afresh: lstune.estimate.memory.forget_byte_models)."""
    _pinned_copy_bytes.cache_clear()
