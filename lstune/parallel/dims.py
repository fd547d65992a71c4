"""How the processes of a run are split between data parallelism (DP) and sequence parallelism (SP).

`ParallelDims` is the one object that knows the layout: it validates `dp × sp == world_size`, picks the
SP degree for `--sp auto`, and owns the process groups once torch.distributed is up. It is passed to
whatever needs a group (Ulysses attention, the SP data adapter, the loss, the DeepSpeed engine); nothing
reads a global. (Same role as torchtitan's `ParallelDims`.)

Rank layout: SP groups are blocks of consecutive ranks (`[0..sp)`, `[sp..2sp)`, …) and DP groups are the
ranks with the same position in their block. Launchers number the ranks of a node consecutively, so an
SP group stays inside a node whenever `sp` ≤ GPUs per node: Ulysses all-to-alls run four times per layer
and need the fast intra-node links, while DP only all-reduces gradients once per step.

Ulysses × ring (`ring` R > 1, lstune.parallel.ring): the SP degree is U × R — U Ulysses ranks (head shards) times R
ring positions (sequence shards whose K/V blocks travel rank to rank). Inside an SP block, SP rank s is ring position
s // U and Ulysses rank s % U: the U ranks of a Ulysses group are consecutive (inside a node: their all-to-alls are
the heavy, non-overlapped traffic), a ring group takes every U-th rank (it spans nodes: its point-to-point sends
overlap with the blocks it computes). Ulysses stops at the query heads; the ring does not, so SP may exceed them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lstune.errors import ConfigError


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def heads_split_evenly(sp: int, q_heads: int, kv_heads: int) -> bool:
    """True when `sp` ranks can each take the same number of q heads with whole kv groups (ALST 3.2.1).

    That is: q heads divide by sp, and kv heads are either sharded (kv % sp == 0) or replicated
    (sp % kv == 0). Other degrees still work (uneven head partition, see `ulysses.HeadPlan`) but some
    ranks then carry one head more than others.
    """
    return q_heads % sp == 0 and (kv_heads % sp == 0 or sp % kv_heads == 0)


def valid_sp_degrees(world_size: int, q_heads: int | None = None) -> list[int]:
    """SP degrees usable with `world_size` processes: divisors of the world size, at most one per q head.

    SP must divide the world size so the remaining factor is a whole DP degree. With more SP ranks than
    q heads some ranks would hold no head at all and idle through every attention.
    """
    return [d for d in divisors(world_size) if q_heads is None or d <= q_heads]


def auto_ring_degree(sp: int, q_heads: int | None, node_size: int | None = None) -> int:
    """The ring part `--sp-ring auto` gives an SP degree `sp`: Ulysses takes the largest divisor of `sp` the query
    heads allow (uneven head plans included: at most one rank per head) and, when `node_size` (GPUs per node) is
    known, one that keeps a Ulysses group inside a node; the ring takes the rest."""
    fits = [u for u in divisors(sp) if (q_heads is None or u <= q_heads) and (node_size is None or u <= node_size)]
    return sp // max(fits)


def auto_sp_degree(world_size: int, q_heads: int, kv_heads: int) -> int:
    """The SP degree `--sp auto` picks.

    Rule: the largest valid degree whose head split is even (`heads_split_evenly`), with the rest of the
    world size going to DP. If only SP=1 splits evenly but more ranks exist (e.g. 9 heads on 8 GPUs),
    take the largest valid degree instead, with an uneven head partition: a long-sequence run gains far
    more from sharding the sequence than it loses to one extra head on some ranks. Give `--sp N` to
    trade differently (e.g. SP=8 for 28 heads when the sequence only fits at 8).
    """
    valid = valid_sp_degrees(world_size, q_heads)
    even = [d for d in valid if heads_split_evenly(d, q_heads, kv_heads)]
    best_even = max(even)
    return best_even if best_even > 1 or world_size == 1 else max(valid)


@dataclass
class ParallelDims:
    """The DP × SP layout of `world_size` processes, and (after `build_groups`) their process groups.

    `sp` is an int or "auto" (which needs the model's head counts, `q_heads` and `kv_heads`). An invalid
    degree raises `ConfigError` naming the valid ones.
    """

    world_size: int
    sp: int | str = 1
    q_heads: int | None = None
    kv_heads: int | None = None
    rank: int = 0
    ring: int | str = 1
    node_size: int | None = None
    sp_group: Any = field(default=None, repr=False)
    dp_group: Any = field(default=None, repr=False)
    ulysses_group: Any = field(default=None, repr=False)
    ring_group: Any = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.kv_heads is None:
            self.kv_heads = self.q_heads
        self.sp = self._resolve_sp()
        self.ring = self._resolve_ring()

    def _resolve_ring(self) -> int:
        if self.ring == "auto":
            return auto_ring_degree(self.sp, self.q_heads, self.node_size)
        ring = int(self.ring)
        ulysses = self.sp // ring if ring >= 1 and self.sp % ring == 0 else None
        if ulysses is None or (self.q_heads is not None and ulysses > self.q_heads):
            fits = [r for r in divisors(self.sp) if self.q_heads is None or self.sp // r <= self.q_heads]
            raise ConfigError([f"--sp-ring {ring} does not fit --sp {self.sp}: the ring part must divide the SP degree "
                               f"and leave a Ulysses part (SP / ring) of at most the {self.q_heads} attention heads; "
                               f"use one of {', '.join(map(str, fits))} or --sp-ring auto."])
        return ring

    def _resolve_sp(self) -> int:
        if self.sp == "auto" and self.ring not in (1, "1"):
            return self.world_size  # a ring asked for (or auto): every process to sequence parallelism
        if self.sp == "auto":
            if self.q_heads is None:
                return self.world_size
            return auto_sp_degree(self.world_size, self.q_heads, self.kv_heads)
        sp = int(self.sp)
        # With a ring, SP may pass the head count (Ulysses takes at most one rank per head, the ring the rest).
        valid = valid_sp_degrees(self.world_size, None if self.ring != 1 else self.q_heads)
        if sp not in valid:
            heads = f" and {self.q_heads} attention heads" if self.q_heads is not None else ""
            raise ConfigError(
                [
                    f"--sp {sp} does not fit {self.world_size} process(es){heads}: SP must divide the number "
                    f"of processes (the rest is data parallelism) and, without --sp-ring, be at most the number of "
                    f"heads; use one of {', '.join(map(str, valid))}, --sp auto, or --sp-ring auto to go past the "
                    "heads with ring attention."
                ]
            )
        return sp

    @classmethod
    def for_model(cls, world_size: int, sp: int | str, model_config: Any, ring: int | str = 1,
                  node_size: int | None = None) -> "ParallelDims":
        """Dims for a transformers model config (its text config for multimodal models). A model without attention
        heads takes its cap from its token mixers' units (`introspect.mixer_units`: Mamba-1's channels, Mamba-2's
        heads), which SP splits head-parallel like Ulysses (lstune.models.mixers); one with neither counts as one
        head (sequence parallelism cannot split it)."""
        from lstune.models.introspect import attention_heads, mixer_units

        heads = attention_heads(model_config)
        units = mixer_units(model_config) if heads is None else None
        if heads is None and units is None and sp not in (1, "1", "auto"):
            raise ConfigError([f"--sp {sp}: this model has no attention heads and no token mixer lstune splits "
                               "head-parallel (a recurrent model of another family), and sequence parallelism splits "
                               "heads; use --sp 1 (or auto)."])
        if heads is None and ring not in (1, "1"):
            raise ConfigError([f"--sp-ring {ring}: this model has no attention heads; ring attention needs attention. "
                               "Use --sp-ring 1."])
        q, kv, _ = heads or (units or 1, units or 1, 0)
        return cls(world_size, sp, q_heads=q, kv_heads=kv, ring=ring, node_size=node_size)

    @property
    def dp(self) -> int:
        return self.world_size // self.sp

    @property
    def sp_rank(self) -> int:
        return self.rank % self.sp

    @property
    def dp_rank(self) -> int:
        return self.rank // self.sp

    @property
    def ulysses(self) -> int:
        """Ulysses ranks (head shards) per ring position: sp // ring."""
        return self.sp // self.ring

    @property
    def ulysses_rank(self) -> int:
        return self.sp_rank % self.ulysses

    @property
    def ring_rank(self) -> int:
        return self.sp_rank // self.ulysses

    def ring_group_ranks(self, block: int, u: int) -> list[int]:
        """Global ranks of SP block `block`'s ring group of Ulysses rank `u`, in ring order."""
        return [block * self.sp + r * self.ulysses + u for r in range(self.ring)]

    def ulysses_group_ranks(self, block: int, ring_rank: int) -> list[int]:
        start = block * self.sp + ring_rank * self.ulysses
        return list(range(start, start + self.ulysses))

    @property
    def world_comm(self):
        """Collectives over every process (lstune.parallel.comm.Communicator)."""
        from lstune.parallel.comm import Communicator

        return Communicator.of()

    @property
    def sp_comm(self):
        """Collectives over this rank's SP group (after `build_groups`; this process alone before)."""
        from lstune.parallel.comm import Communicator

        return Communicator.of(self.sp_group)

    def sp_group_ranks(self, block: int) -> list[int]:
        return list(range(block * self.sp, (block + 1) * self.sp))

    def dp_group_ranks(self, position: int) -> list[int]:
        return list(range(position, self.world_size, self.sp))

    def build_groups(self) -> "ParallelDims":
        """Create the SP and DP process groups. Every rank must call it (group creation is collective).

        Needs an initialised torch.distributed whose world size matches. Returns self.
        """
        import torch.distributed as dist

        if not dist.is_initialized():
            raise RuntimeError("ParallelDims.build_groups needs torch.distributed to be initialised first")
        if dist.get_world_size() != self.world_size:
            raise RuntimeError(f"world size is {dist.get_world_size()}, ParallelDims has {self.world_size}")
        self.rank = dist.get_rank()
        # new_group must be called by every rank for every group, in the same order.
        for block in range(self.dp):
            group = dist.new_group(self.sp_group_ranks(block))
            if block == self.dp_rank:
                self.sp_group = group
        for position in range(self.sp):
            group = dist.new_group(self.dp_group_ranks(position))
            if position == self.sp_rank:
                self.dp_group = group
        self.ulysses_group, self.ring_group = self.sp_group, None
        if self.ring > 1:
            for block in range(self.dp):
                for ring_rank in range(self.ring):
                    group = dist.new_group(self.ulysses_group_ranks(block, ring_rank))
                    if (block, ring_rank) == (self.dp_rank, self.ring_rank):
                        self.ulysses_group = group
                for u in range(self.ulysses):
                    group = dist.new_group(self.ring_group_ranks(block, u))
                    if (block, u) == (self.dp_rank, self.ulysses_rank):
                        self.ring_group = group
        return self
