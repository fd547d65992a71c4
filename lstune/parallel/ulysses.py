"""Ulysses sequence parallelism for any Hugging Face causal LM (ALST Sec. 3.2, 3.2.1, 4.2).

Outside attention every SP rank holds a 1/sp shard of the sequence — contiguous, or with chunked attention
FPDT's pieces (`sp_data`, lstune.models.chunk_layout); nothing there mixes tokens, so embeddings, norms, MLPs
and the loss run on the shard unchanged. At attention the wrapper

1. all-to-alls q/k/v from sequence shards `[B, H, S/sp, D]` to head shards `[B, H_r, S, D]` (rank r holds
   the full sequence for its heads H_r),
2. all-gathers position_ids across the SP group, so the kernel sees the full sequence's positions
   (causality and packed-document boundaries come from them — never from a 4D mask),
3. runs the model's own attention kernel (lstune's local attention, FlashAttention-2, flex, SDPA) on
   those heads,
4. all-to-alls the output back to sequence shards with all heads.

Learned attention sinks (gpt-oss's `s_aux`, one logit per q head) go to the kernel sliced to the rank's q heads.

Memory: activations outside attention are O(S/sp) per rank; inside attention q/k/v/out are
O(S·H/sp) — the whole sequence, for 1/sp of the heads. Cost: four all-to-alls per layer of about
B·S·(H + 2·H_kv')·D/sp elements each way (H_kv' counts kv heads after replication), which cannot overlap
with compute, so SP groups should sit on intra-node links (see `dims.py`). Composes with tiled MLP /
tiled loss (they work on the local shard), activation checkpointing (the recompute repeats the
collectives in the same order on every rank) and ZeRO (parameters are replicated across SP, gradients
summed over it — see `loss.py`).

Heads (ALST 3.2.1 and beyond): `HeadPlan` gives each rank a contiguous range of q heads and the kv
heads those q heads use. When the counts divide (the ALST cases) this is the classic layout: q sharded,
kv sharded or replicated up to sp. When they do not (9 heads on 4 ranks, 28q/4kv on 8, 40 on 16), the
ranges are uneven — sizes differ by one head — and the all-to-all uses uneven splits, so every byte
sent is a real head (no dummy-head padding). A rank whose q heads do not use whole kv groups sees them
with a per-q-head copy of k/v (MHA layout for that rank). docs/parallel.md compares the alternatives.

Registration goes through transformers' attention interface (lstune.models.attention's
`register_attention_function`): the wrapper is registered under its own key with a mask function that
builds nothing, and the model is switched to that key — the model code is untouched and no 4D mask is
ever created. `undo()` restores the model's attention and removes the key. Nothing is patched at
import time.
"""

from __future__ import annotations

import itertools
import logging
import warnings
from dataclasses import dataclass
from functools import cached_property, lru_cache
from typing import TYPE_CHECKING, Any, Callable

from lstune.errors import DataError, ModelError

if TYPE_CHECKING:
    import torch

    from lstune.parallel.dims import ParallelDims

log = logging.getLogger(__name__)

# Kernels that take a 4D mask and would attend across the whole gathered sequence without it.
_MASK_ONLY_KERNELS = ("eager", "paged|eager")
# Kernels that ignore position_ids: right only when each row is one document and no sliding window cuts in.
_POSITION_BLIND_KERNELS = ("sdpa",)


@dataclass(frozen=True)
class HeadPlan:
    """Which attention heads each of `sp` ranks holds inside attention.

    Rank r gets q heads `[q_starts[r], q_starts[r] + q_counts[r])`, balanced so counts differ by at most
    one, and the kv heads `[kv_starts[r], kv_starts[r] + kv_counts[r])` its q heads read (q head i reads
    kv head i // (q_heads // kv_heads)). kv heads used by several ranks are sent to each of them
    (replication, ALST 3.2.1 case 2b).
    """

    q_heads: int
    kv_heads: int
    sp: int

    def __post_init__(self) -> None:
        if self.q_heads % self.kv_heads:
            raise ModelError(f"{self.q_heads} q heads is not a multiple of {self.kv_heads} kv heads")
        if self.sp > self.q_heads:
            raise ModelError(
                f"SP degree {self.sp} is larger than the {self.q_heads} attention heads; use --sp {self.q_heads} "
                "or less (the remaining processes become data parallel)."
            )

    @property
    def group_size(self) -> int:
        return self.q_heads // self.kv_heads

    @cached_property
    def q_counts(self) -> tuple[int, ...]:
        base, extra = divmod(self.q_heads, self.sp)
        return tuple(base + (r < extra) for r in range(self.sp))

    @cached_property
    def q_starts(self) -> tuple[int, ...]:
        return tuple(itertools.accumulate((0,) + self.q_counts[:-1]))

    @cached_property
    def kv_starts(self) -> tuple[int, ...]:
        return tuple(start // self.group_size for start in self.q_starts)

    @cached_property
    def kv_counts(self) -> tuple[int, ...]:
        stops = [(s + c - 1) // self.group_size + 1 for s, c in zip(self.q_starts, self.q_counts)]
        return tuple(stop - start for start, stop in zip(self.kv_starts, stops))

    @cached_property
    def kv_send_index(self) -> tuple[int, ...]:
        """The kv heads each rank sends, destination by destination (heads used by two ranks appear twice)."""
        return tuple(h for s, c in zip(self.kv_starts, self.kv_counts) for h in range(s, s + c))

    @property
    def is_even(self) -> bool:
        return len(set(self.q_counts)) == 1 and len(set(self.kv_counts)) == 1

    def local_kv_index(self, rank: int) -> tuple[int, ...] | None:
        """For rank `rank`: None when its q heads use its kv heads in equal groups (a regular GQA layout the
        kernel handles), else the local kv head each local q head reads (k/v get expanded to one per q head).
        """
        q0, nq, kv0 = self.q_starts[rank], self.q_counts[rank], self.kv_starts[rank]
        local = [(q0 + i) // self.group_size - kv0 for i in range(nq)]
        per_kv = [local.count(j) for j in range(self.kv_counts[rank])]
        return None if len(set(per_kv)) == 1 else tuple(local)

    def elements_sent(self, batch: int, local_seq: int, head_dim: int) -> int:
        """Elements one rank sends (and receives) per attention call in forward: q, k, v and the output."""
        kv_sent = len(self.kv_send_index)
        return batch * local_seq * head_dim * (2 * self.q_heads + 2 * kv_sent)


def _all_to_all(x: "torch.Tensor", out_splits: list[int], in_splits: list[int], group: Any) -> "torch.Tensor":
    """Differentiable all_to_all_single along dim 0 with (possibly uneven) splits.

    torch.distributed.nn.functional's version has the autograd rule (backward = all-to-all with the
    splits swapped) and runs on gloo and NCCL across torch 2.7–2.13; 2.13 marks it deprecated in favour
    of the functional-collectives API, whose autograd support is newer than our minimum torch.
    """
    from torch.distributed.nn.functional import all_to_all_single

    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)


class SequenceExchange:
    """The all-to-alls between sequence shards and head shards over one SP group, and the gathered position_ids:
    what Ulysses attention and the head-parallel token mixers (lstune.models.mixers) share."""

    def __init__(self, dims: "ParallelDims", *, ulysses_only: bool = False):
        # The whole SP group in SP rank order (the token mixers' head-parallel group, ring ranks included), or with
        # `ulysses_only` its Ulysses part (attention's: the ring runs inside it); the same without a ring (dims.py).
        self.ring = 1 if ulysses_only else dims.ring
        self.sp = dims.ulysses if ulysses_only else dims.sp
        self.sp_rank = dims.ulysses_rank if ulysses_only else dims.sp_rank
        self.group = dims.ulysses_group if ulysses_only else dims.sp_group
        # The whole SP group (Ulysses × ring), whose ranks attend in step: where a check of one shard must agree.
        self.sp_group, self.sp_whole = dims.sp_group, dims.sp
        self._positions_in: Any = None
        self._positions_out: Any = None

    def unit_counts(self, units: int, what: str = "a linear-attention / state-space layer") -> tuple[int, ...]:
        """How many of `units` heads (or channel groups) each rank holds: Ulysses' balanced, possibly uneven plan."""
        if units < self.sp:
            ring = (f" (under --sp-ring {self.ring} over the whole SP group, ring ranks included: only the whole "
                    "timeline puts ring attention's zigzag pieces in order)" if self.ring > 1 else "")
            raise ModelError(f"SP degree {self.sp} is larger than the {units} heads of {what}, which sequence "
                             f"parallelism splits like attention heads{ring}; use --sp {units} or less.")
        return _plan(units, units, self.sp).q_counts

    def seq_to_units(self, x_BsUw, counts):
        """`[B, S/sp, U, w]` (all units, my shard) → `[B, S, u, w]` (my units, whole sequence)."""
        return self.seq_to_heads(x_BsUw.transpose(1, 2), counts, counts[self.sp_rank]).transpose(1, 2)

    def units_to_seq(self, y_BSuw, counts):
        """`[B, S, u, w]` (my units, whole sequence) → `[B, S/sp, U, w]` (all units, my shard)."""
        return self.heads_to_seq(y_BSuw.contiguous(), counts)

    def sum_over_group(self, x):
        """The sum of `x` over the SP group's ranks, differentiable (its backward sums the gradients the same way)."""
        from torch.distributed.nn.functional import all_reduce

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            return all_reduce(x, group=self.group)

    def agreed(self, check):
        """`check()` on every rank of the SP group, all ending alike (lstune.parallel.comm.Communicator.agreed): a
        check of this rank's own shard refuses on every rank, with the refusing rank's message, before the next
        all-to-all or ring exchange would wait for it."""
        from lstune.parallel.comm import Communicator

        return Communicator.of(self.sp_group).agreed(check)

    def seq_to_heads(self, x_BHsD, counts, my_count, send_index=None):
        """`[B, H, S/sp, D]` (all heads, my shard) → `[B, h, S, D]` (my heads, whole sequence)."""
        import torch

        x_HBsD = x_BHsD.transpose(0, 1)
        if send_index is not None and list(send_index) != list(range(x_HBsD.shape[0])):
            x_HBsD = x_HBsD.index_select(0, _index_tensor(send_index, x_HBsD.device))
        if self.sp == 1:
            return x_HBsD.transpose(0, 1)
        recv = _all_to_all(x_HBsD, [my_count] * self.sp, list(counts), self.group)
        b, s, d = recv.shape[1:]
        # recv holds, for each source rank (= sequence shard) in order, my heads: [sp, h, B, s, D].
        recv = recv.view(self.sp, my_count, b, s, d).permute(2, 1, 0, 3, 4)
        return torch.reshape(recv, (b, my_count, self.sp * s, d))

    def heads_to_seq(self, out_BShD, counts):
        """`[B, S, h, D]` (my heads, whole sequence) → `[B, S/sp, H, D]` (all heads, my shard)."""
        if self.sp == 1:
            return out_BShD
        b, seq, h, d = out_BShD.shape
        s = seq // self.sp
        send = out_BShD.reshape(b, self.sp, s, h, d).permute(1, 3, 0, 2, 4).reshape(self.sp * h, b, s, d)
        recv_HBsD = _all_to_all(send, list(counts), [h] * self.sp, self.group)
        # Contiguous, as transformers' own attention functions return it: models `.view` the output (AFMoE, JetMoE);
        # the usual `.reshape` would copy the permuted tensor anyway, so this costs those nothing.
        return recv_HBsD.permute(1, 2, 0, 3).contiguous()

    def full_positions(self, position_ids_Bs):
        """position_ids of the whole sequence `[B, S]`, gathered once per forward (every layer reuses it): the
        shards in rank order, i.e. contiguous shards. Under chunked attention each call gathers one chunk, which
        FPDT's layout makes contiguous too; an unchunked call never sees FPDT's pieces (one chunk: not reordered).
        The token mixers gather whole shards under every layout and reorder them (lstune.models.mixers.ShardOrder)."""
        import torch
        import torch.distributed as dist

        if position_ids_Bs is None:
            raise DataError(
                "sequence parallelism needs position_ids at every attention call (they carry causality and "
                "document boundaries across shards), and this one got none: either the batch has none (batches "
                "from lstune's data pipeline and SP adapter have them) or the model does not pass them to its "
                "attention layers, which lstune cannot shard (use --sp 1)."
            )
        if self.sp == 1:
            return position_ids_Bs
        if position_ids_Bs is self._positions_in:
            return self._positions_out
        shard = position_ids_Bs.contiguous()
        gathered = [torch.empty_like(shard) for _ in range(self.sp)]
        dist.all_gather(gathered, shard, group=self.group)
        full = torch.cat(gathered, dim=1)
        self._positions_in, self._positions_out = position_ids_Bs, full
        return full


class UlyssesAttention(SequenceExchange):
    """The attention-interface function that runs any kernel under Ulysses SP. Created by `apply_ulysses`."""

    def __init__(self, core: Callable, core_name: str, dims: "ParallelDims"):
        super().__init__(dims, ulysses_only=True)
        self.core = core
        self.core_name = core_name
        self._documents_checked: Any = None

    def plan(self, q_heads: int, kv_heads: int) -> HeadPlan:
        return _plan(q_heads, kv_heads, self.sp)

    def __call__(self, module, query, key, value, attention_mask, **kwargs):
        """HF attention signature: q/k/v `[B, H, S/sp, D]` → (`[B, S/sp, H, D]`, None). v may have its own head
        dim (multi-head latent attention); each tensor is exchanged with its own."""
        from lstune.models.attention import window_from_mask
        from lstune.models.attention_sinks import head_sinks

        plan = self.plan(query.shape[1], key.shape[1])
        if kwargs.get("s_aux") is not None:  # learned sinks (gpt-oss): one per q head, the rank's slice
            kwargs["s_aux"] = head_sinks(kwargs["s_aux"], plan.q_starts[self.sp_rank], plan.q_counts[self.sp_rank])
        # The window a model names only in its mask is read (and the mask checked) on this rank's shard.
        window = window_from_mask(attention_mask, kwargs.get("position_ids"), kwargs.get("sliding_window"),
                                  query.shape[2], query.device, self.agreed if self.sp_whole > 1 else None)
        kwargs["sliding_window"] = window
        positions = self.full_positions(kwargs.get("position_ids"))
        if getattr(attention_mask, "chunk", None):  # chunked attention (Llama-4): each chunk a document
            from lstune.models.attention import chunk_positions

            positions = chunk_positions(positions, attention_mask.chunk)
        self._check_kernel_fits(positions, window)
        q_BhSD = self.seq_to_heads(query, plan.q_counts, plan.q_counts[self.sp_rank])
        kv_index = plan.kv_send_index
        k_BhSD = self.seq_to_heads(key, plan.kv_counts, plan.kv_counts[self.sp_rank], kv_index)
        v_BhSD = self.seq_to_heads(value, plan.kv_counts, plan.kv_counts[self.sp_rank], kv_index)
        expand = plan.local_kv_index(self.sp_rank)
        if expand is not None:
            index = _index_tensor(expand, k_BhSD.device)
            k_BhSD, v_BhSD = k_BhSD.index_select(1, index), v_BhSD.index_select(1, index)
        view = _LocalHeads(module, q_BhSD.shape[1] // k_BhSD.shape[1])
        kwargs["position_ids"] = positions
        out_BShD, _ = self.core(view, q_BhSD, k_BhSD, v_BhSD, None, **kwargs)
        return self.heads_to_seq(out_BShD, plan.q_counts), None

    def _check_kernel_fits(self, positions_BS, sliding_window) -> None:
        """A position-blind kernel (HF SDPA with no mask) is only right for one document per row, no window."""
        if self.core_name not in _POSITION_BLIND_KERNELS:
            return
        if sliding_window is not None and sliding_window < positions_BS.shape[1]:
            raise ModelError(
                f"attention kernel '{self.core_name}' cannot apply a {sliding_window}-token sliding window under "
                "sequence parallelism; use lstune's attention (--attn auto) or flash_attention_2."
            )
        if positions_BS is self._documents_checked:  # once per forward, not per layer (it syncs the device)
            return
        import torch

        expected = torch.arange(positions_BS.shape[1], device=positions_BS.device)
        if not bool((positions_BS == positions_BS[:, :1] + expected).all()):
            raise DataError(
                f"packed samples need a document-aware attention kernel, and '{self.core_name}' ignores "
                "position_ids under sequence parallelism; use lstune's attention (--attn auto) or "
                "flash_attention_2, or train without packing."
            )
        self._documents_checked = positions_BS


class _LocalHeads:
    """The attention module as the kernel sees it inside Ulysses: same module, local q-per-kv ratio.

    HF kernels read `module.num_key_value_groups` to repeat kv heads; inside Ulysses that ratio is the
    local one (it changes with replication or uneven plans), and the real module must stay untouched.
    """

    def __init__(self, module: Any, num_key_value_groups: int):
        self._module = module
        self.num_key_value_groups = num_key_value_groups

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


def _index_tensor(values, device):
    import torch

    return torch.tensor(values, dtype=torch.long, device=device)


@lru_cache(maxsize=None)
def _plan(q_heads: int, kv_heads: int, sp: int) -> HeadPlan:
    return HeadPlan(q_heads, kv_heads, sp)


# transformers' built-in kernels that cannot run Ulysses' gathered sequence correctly without a mask:
# eager needs a [seq, seq] mask; HF's sdpa and flex ignore position_ids once the mask is gone (packed
# documents would attend to each other). By default they are replaced by lstune's attention, which runs
# the same kernels per document from position_ids.
_REPLACED_BY_DEFAULT = ("eager", "paged|eager", "sdpa", "flex_attention")


@dataclass
class UlyssesHandle:
    """What `apply_ulysses` did to a model; `undo()` reverts it (the model's attention is restored)."""

    registration: Any
    attention: UlyssesAttention

    def undo(self) -> None:
        self.registration.undo()


def _default_core(model: Any) -> tuple[Callable, str]:
    from lstune.models import hf_internals
    from lstune.models.attention import lstune_attention_forward, sinks_module

    current = hf_internals.attention_implementation(model.config)
    current_fn = hf_internals.attention_function(current)
    if current in _REPLACED_BY_DEFAULT or current_fn is None:
        if (where := sinks_module(model)) is not None:
            raise ModelError(
                f"{where} has learned attention sinks, which lstune's attention runs through its block kernel: "
                "install lstune's attention with use_lstune_attention(model, block_kernel=lstune.memory."
                "block_attention.block_attention) before apply_ulysses (lstune train does)."
            )
        return lstune_attention_forward, "lstune"
    return current_fn, current


def apply_ulysses(model: Any, dims: "ParallelDims", core: str | Callable | None = None,
                  core_name: str | None = None) -> UlyssesHandle:
    """Run `model`'s attention under Ulysses SP over `dims.sp_group`; returns a handle with `undo()`.

    `core` is the kernel run on each rank's heads: an attention-interface key or a function with the HF
    attention signature. Default: the model's current attention function when it is document-aware
    (lstune's attention — apply `use_lstune_attention` first to choose its backend — or FlashAttention-2),
    otherwise lstune's attention with backend "auto"; under Ulysses × ring the ring attention kernel
    (lstune.memory.attention_ring.RingAttention, composed by lstune.train) over the ring position's whole
    sequence, with the all-to-alls over the Ulysses part of the group. Every forward must then get its sequence shard
    with `position_ids` (see `sp_data.SPDataAdapter`). Order (docs/memory.md): after LoRA and the attention
    backend, before tiled MLP / loss head / checkpointing.
    """
    from lstune.models import hf_internals
    from lstune.models.attention import register_attention_function

    if core is None:
        core_fn, core_name = _default_core(model)
    elif isinstance(core, str):
        if core in _MASK_ONLY_KERNELS:
            raise ModelError(
                f"attention '{core}' needs a [seq, seq] mask, which sequence parallelism never builds; use "
                "--attn auto (lstune's attention), flex or flash_attention_2."
            )
        core_fn, core_name = hf_internals.attention_function(core), core
        if core_fn is None:
            raise ModelError(f"no attention function is registered as {core!r} in transformers' AttentionInterface.")
    else:
        core_fn, core_name = core, core_name or getattr(core, "__name__", "custom")
    if dims.sp > 1 and dims.sp_group is None:
        raise RuntimeError("ParallelDims.build_groups() must run before apply_ulysses with sp > 1")
    attention = UlyssesAttention(core_fn, core_name, dims)
    registration = register_attention_function(
        model, attention, description=f"Ulysses SP={dims.ulysses} around {core_name}"
    )
    log.info("Ulysses SP on %d ranks around attention %r", dims.ulysses, core_name)
    return UlyssesHandle(registration, attention)
