"""What Ulysses × ring sequence parallelism and METP's MLP cost per rank: device bytes, bytes moved per step, and the
time those bytes take at the link rates — PREDICTED by formula from the model's shape (lstune.estimate.shapes).

Layout (lstune.parallel.dims): SP = U Ulysses ranks (a group inside a node: NVLink) × R ring positions (a group across
nodes when SP exceeds a node: the network). Each rank holds S/SP tokens of a sample outside attention.

Bytes moved per layer, per rank, b bytes per activation element, t = B·S/SP local tokens, q/kv the full widths:
- Ulysses: four all-to-alls in forward (q, k, v, out) and four in backward, each sending (U−1)/U of
  t·(2·q + 2·kv′) elements (kv′: kv heads after replication, at least U heads' worth) — ALST; not overlapped.
- ring (R > 1, lstune.memory.attention_ring): each hop fetches one K/V block of B·S/R tokens × 2·kv/U (forward),
  again in backward, plus its fp32 dK/dV back home: (hops − 1)·(B·S/R)·2·(kv/U)·(2·b + 4); overlapped with the
  block compute when a hop's attention outlasts its transfer (METP's condition, Sec. 3.3). With chunked attention
  under the ring (`ring_gathered`) each chunk's K/V is all-gathered over the ring instead and its fp32 dK/dV
  reduce-scattered home: the same bytes, synchronous (not overlapped).
- METP's MLP (p = SP): (p−1)/p of the MLP weights (3·H·I elements, gated) each way in forward, twice that in backward
  (weights and fp32 gradient sums) — METP's 3·(p−1)/p·(k1·k2 + k2·n) (Table 1), independent of S.
Activation checkpointing re-runs the forward in backward: its share once more.

Link rates (`LINKS`): NVLink 4 on H100/H200, 450 GB/s per direction per GPU; the network, 400 Gb/s InfiniBand per GPU
(50 GB/s) — data-sheet rates, not measured here; the time is bytes / rate (no latency, no contention): a floor.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

NVLINK_BYTES_PER_S = 450e9
NETWORK_BYTES_PER_S = 50e9


@dataclass(frozen=True)
class SPTraffic:
    """One rank's sequence-parallel traffic per optimizer step and its time at the link rates (PREDICTED)."""

    ulysses: int
    ring: int
    ulysses_bytes: int  # all-to-alls (intra-node)
    ring_bytes: int  # K/V blocks and their gradients (across nodes when the ring spans them)
    metp_bytes: int  # METP's MLP weight shards and their gradient sums
    ulysses_s: float
    ring_s: float
    metp_s: float
    ring_overlap: bool  # a hop's attention outlasts its transfer (the ring's time hides under compute)
    ring_gathered: bool = False  # chunked attention under the ring: each chunk's K/V all-gathered (not overlapped)

    def to_dict(self) -> dict:
        return asdict(self)


def _kv_local(shape: Any, ulysses: int) -> int:
    """kv width one Ulysses rank holds: its share, at least one head (replication)."""
    return max(shape.kv_width // ulysses, shape.head_dim)


def ring_hop_count(ring: int) -> int:
    """Hops with a transfer in a ring of `ring` positions (full causal attention: every hop but the local one)."""
    return max(0, ring - 1)


def sp_traffic(shape: Any, *, seq_len: int, micro_batch: int, sp: int, ring: int, act_bytes: int = 2,
               metp_mlp: bool = False, checkpointing: bool = True, micro_batches: int = 1,
               attention_flops_per_s: float = 500e12, node_size: int = 8, metp_trainable: bool = True,
               ring_gathered: bool = False) -> SPTraffic:
    """The bytes one rank moves per step (`micro_batches` forward+backward passes) and their time (module doc). An
    SP group wider than a node (`node_size` GPUs) puts the ring's and METP's sends on the network. METP's gradient
    sums travel only when its shards train (`metp_trainable`; LoRA leaves them frozen)."""
    ulysses = sp // ring
    forward_runs = 2 if checkpointing else 1
    t = micro_batch * seq_len // sp
    kv_sent = max(shape.kv_width, ulysses * shape.head_dim)
    # An attention-free model's mixer (ModelShape.mixer_exchanged) moves its streams where attention moves q, k, v, o
    width = getattr(shape, "mixer_exchanged", 0) or 2 * shape.q_width + 2 * kv_sent
    a2a = (ulysses - 1) / ulysses * t * width * act_bytes if ulysses > 1 else 0
    per_layer_ulysses = a2a * (forward_runs + 1)
    block = micro_batch * seq_len // ring * 2 * _kv_local(shape, ulysses)
    hops = ring_hop_count(ring)
    per_layer_ring = hops * block * (act_bytes * (forward_runs + 1) + 4) if ring > 1 else 0
    mlp_weights = (3 if shape.gated else 2) * shape.hidden * shape.intermediate
    sums = 4 if metp_trainable else 0
    per_layer_metp = (sp - 1) / sp * mlp_weights * (act_bytes * (forward_runs + 1) + sums) if metp_mlp and sp > 1 else 0
    layers = shape.layers * micro_batches
    u_bytes, r_bytes, m_bytes = (int(x * layers) for x in (per_layer_ulysses, per_layer_ring, per_layer_metp))
    ring_rate = NETWORK_BYTES_PER_S if sp > node_size else NVLINK_BYTES_PER_S
    # A hop: B·S/R queries of q/U width against B·S/R keys, half of them masked on average (causal, zigzag balanced).
    hop_flops = 2 * (micro_batch * seq_len / ring) ** 2 * (shape.q_width / ulysses) * 2 / 2
    hop_bytes = block * act_bytes
    ulysses_rate = NETWORK_BYTES_PER_S if ulysses > node_size else NVLINK_BYTES_PER_S
    return SPTraffic(ulysses, ring, u_bytes, r_bytes, m_bytes, u_bytes / ulysses_rate, r_bytes / ring_rate,
                     m_bytes / ring_rate,
                     ring <= 1 or (not ring_gathered and hop_flops / attention_flops_per_s >= hop_bytes / ring_rate),
                     ring > 1 and ring_gathered)


def ring_buffer_bytes(shape: Any, *, seq_len: int, micro_batch: int, sp: int, ring: int, act_bytes: int = 2) -> int:
    """Device bytes ring attention adds to one layer's backward on a rank (beyond q, k, v, o, which Ulysses holds
    too): the block computed and the one arriving (K/V, b each, and their document ids), fp32 dK/dV of this rank's
    own block, of the hop computed and of the one on its way home, fp32 dQ and the rowsums; and the score tiles of
    the PyTorch block kernel on one (block × block) block (`_score_tiles`; a piece cut in blocks of at most
    `attention_ring.BLOCK_TOKENS`) — an upper bound on CUDA, where blocks inside
    one document take the flash kernel, which holds none (a memory trace runs every block through the PyTorch one)."""
    if ring <= 1:
        return 0
    ulysses = sp // ring
    tokens = micro_batch * seq_len // ring
    kv = 2 * _kv_local(shape, ulysses)
    heads = max(1, shape.heads // ulysses)
    buffers = tokens * (2 * (kv * act_bytes + 8) + 3 * kv * 4 + shape.q_width // ulysses * 4 + heads * 8)
    from lstune.memory.attention_ring import BLOCK_TOKENS

    piece = max(1, seq_len // (2 * ring))
    block = -(-piece // -(-piece // BLOCK_TOKENS))  # the pieces' equal blocks (attention_ring._blocks_of)
    return int(buffers + _score_tiles(micro_batch, heads, block))


def _score_tiles(batch: int, heads: int, piece: int) -> int:
    """The PyTorch block kernel's live score tiles on one (piece × piece) block (lstune.memory.attention_blocks:
    query rows cut so a fp32 tile holds at most 2²⁶ elements; five tiles alive in a row tile's backward, six with
    more than one row tile), plus the block's bool mask — as lstune.estimate.memory counts them for chunked attention."""
    rows = max(1, (1 << 26) // max(1, batch * heads * piece))
    row_tiles = -(-piece // rows)
    tile = batch * heads * -(-piece // row_tiles) * piece * 4
    return (6 if row_tiles > 1 else 5) * tile + batch * piece * piece


# ---- METP's MLP on one rank (lstune.memory.metp_mlp): what the byte model (lstune.estimate.memory) counts ----------

METP_MASTER_BYTES, METP_GRAD_BYTES, METP_ADAM_BYTES = 4, 4, 8  # fp32 shard masters, fp32 gradients, AdamW's m and v


def metp_applies(shape: Any) -> bool:
    """METP shards dense gated MLPs only (lstune.memory.metp_mlp.check_metp_mlp refuses the others)."""
    return bool(shape.gated and not getattr(shape, "experts", 0))


def metp_shard_elements(shape: Any, sp: int) -> int:
    """One layer's MLP shard on one rank: gate and up column shards and the down row shard, 3·H·I/p elements."""
    return (3 if shape.gated else 2) * shape.hidden * (shape.intermediate // sp)


def metp_state_bytes(shape: Any, sp: int, *, trainable: bool, frozen_bytes: int) -> tuple[int, int, int]:
    """(weights, gradients, AdamW state) of one layer's shard on one rank: the shards train beside the engine
    (lstune.parallel.local_params), never ZeRO-partitioned — trained, fp32 masters with fp32 gradients and their own
    AdamW's two fp32 moments (on the device, also when DeepSpeed offloads its optimizer or its weights); frozen (LoRA on
    attention), the base weights' dtype (`frozen_bytes`) and nothing else."""
    elements = metp_shard_elements(shape, sp)
    if not trainable:
        return elements * frozen_bytes, 0, 0
    return elements * METP_MASTER_BYTES, elements * METP_GRAD_BYTES, elements * METP_ADAM_BYTES


def metp_moment_bytes(shape: Any, *, tokens: int, sp: int, act_bytes: int) -> dict[str, int]:
    """METP's MLP at the peak of one layer's backward on one rank (`_MetpFunction.backward` at a middle step of the
    rotation), by part, beyond what the layer's moment counts anyway (the MLP's input, which METP saves, and the
    incoming gradient):

    - `intermediates`: the step's recomputed (s/p)×(I/p) tensors — gate, activation, up and product saved by the
      step's graph, and their gradients as autograd makes them: 6 of them at the peak;
    - `tokens`: the step's output term, the input gradient's running sum and the step's share: 3 × (s/p)×H;
    - `rotating`: the shard computed and the one arriving (both cast to the tokens' dtype), the fp32 gradient sum on
      its way to the next rank and the one arriving from the previous, and the step's own weight gradients in the
      tokens' dtype as autograd makes them (4/3 of a shard at the peak): (10·b/3 + 8) bytes per shard element. At
      SP 2 a step has either a shard arriving or a sum, not both: an upper bound there.

    The coefficients are the live tensors of the module itself, metered (tests/unit/estimate/test_metp_estimate.py)."""
    width = shape.intermediate // sp
    return {"intermediates": 6 * tokens * width * act_bytes,
            "tokens": 3 * tokens * shape.hidden * act_bytes,
            "rotating": metp_shard_elements(shape, sp) * (10 * act_bytes + 24) // 3}
