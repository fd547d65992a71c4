"""How the processes of a run are split between data parallelism (DP) and sequence parallelism (SP).

`ParallelDims` is the one object that knows the layout: it validates `dp × sp == world_size`, picks the
SP degree for `--sp auto`, and owns the process groups once torch.distributed is up. It is passed to
whatever needs a group (Ulysses attention, the SP data adapter, the loss, the DeepSpeed engine); nothing
reads a global. (Same role as torchtitan's `ParallelDims`.)

Rank layout: SP groups are blocks of consecutive ranks (`[0..sp)`, `[sp..2sp)`, …) and DP groups are the
ranks with the same position in their block. Launchers number the ranks of a node consecutively, so an
SP group stays inside a node whenever `sp` ≤ GPUs per node: Ulysses all-to-alls run four times per layer
and need the fast intra-node links, while DP only all-reduces gradients once per step.
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
    sp_group: Any = field(default=None, repr=False)
    dp_group: Any = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.kv_heads is None:
            self.kv_heads = self.q_heads
        self.sp = self._resolve_sp()

    def _resolve_sp(self) -> int:
        if self.sp == "auto":
            if self.q_heads is None:
                return self.world_size
            return auto_sp_degree(self.world_size, self.q_heads, self.kv_heads)
        sp = int(self.sp)
        valid = valid_sp_degrees(self.world_size, self.q_heads)
        if sp not in valid:
            heads = f" and {self.q_heads} attention heads" if self.q_heads is not None else ""
            raise ConfigError(
                [
                    f"--sp {sp} does not fit {self.world_size} process(es){heads}: SP must divide the number "
                    f"of processes (the rest is data parallelism) and be at most the number of heads; "
                    f"use one of {', '.join(map(str, valid))} or --sp auto."
                ]
            )
        return sp

    @classmethod
    def for_model(cls, world_size: int, sp: int | str, model_config: Any) -> "ParallelDims":
        """Dims for a transformers model config (its text config for multimodal models); a model without attention
        heads counts as one head (Ulysses splits heads: sequence parallelism cannot split it)."""
        from lstune.models.introspect import attention_heads

        heads = attention_heads(model_config)
        if heads is None and sp not in (1, "1", "auto"):
            raise ConfigError([f"--sp {sp}: this model has no attention heads (a state-space / recurrent model), and "
                               "Ulysses sequence parallelism splits attention heads; use --sp 1 (or auto)."])
        q, kv, _ = heads or (1, 1, 0)
        return cls(world_size, sp, q_heads=q, kv_heads=kv)

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
        return self
