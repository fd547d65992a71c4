"""LongRoPE under sequence parallelism: the factors of the whole sample, not of each rank's shard.

LongRoPE (Phi-3's `rope_type: longrope`) picks its frequencies each forward from the longest position it sees:
the long factors past `original_max_position_embeddings`, the short ones below (transformers'
`dynamic_rope_update`). Under SP each rank runs the rotary embedding on its shard's positions, so with a sample
longer than the original context the first ranks would pick the short factors and the last the long ones, while
the model on the whole sample uses the long factors everywhere: loss and gradients off, silently.

`whole_sample_longrope` makes every rank pick from the longest position over its SP group (one all-reduce of a
scalar per forward, before the layers), which is the choice the model makes on the whole sample. Instance-level and
undoable: each rotary module gets a forward pre-hook that sets its frequencies, and its own per-forward choice is
switched off (its `rope_type` renamed, which only transformers' update reads). Packed documents are not handled
here: the model gives each document the factors of its own length, which one row cannot, so lstune refuses
`--pack` past the original context (lstune.models.rope.length_dependent_rope_problems).
"""

from __future__ import annotations

from typing import Any

_SWITCHED = "longrope (factors chosen over the SP group: lstune.parallel.rope_sp)"


class RopeHandle:
    def __init__(self, patched: list[tuple[Any, Any]]):
        self._patched = patched

    @property
    def modules(self) -> int:
        return len(self._patched)

    def undo(self) -> None:
        for module, hook in self._patched:
            hook.remove()
            module.rope_type = "longrope"
        self._patched = []


def whole_sample_longrope(model: Any, group: Any) -> RopeHandle:
    """Patch every LongRoPE rotary embedding of `model` to choose its factors from the longest position over the
    process group `group` (the SP group); a handle whose `undo` restores them."""
    patched = []
    for module in model.modules():
        if getattr(module, "rope_type", None) == "longrope" and hasattr(module, "original_inv_freq"):
            hook = module.register_forward_pre_hook(_choose_over(group), with_kwargs=True)
            module.rope_type = _SWITCHED
            patched.append((module, hook))
    return RopeHandle(patched)


def _choose_over(group: Any):
    def hook(module: Any, args: tuple, kwargs: dict) -> None:
        import torch
        import torch.distributed as dist

        x = args[0] if args else kwargs["x"]
        position_ids = args[1] if len(args) > 1 else kwargs["position_ids"]
        longest = position_ids.max().to(torch.int64).reshape(1)
        dist.all_reduce(longest, op=dist.ReduceOp.MAX, group=group)
        original = module.config.rope_parameters["original_max_position_embeddings"]
        use_long = int(longest.item()) + 1 > original
        module.inv_freq.copy_(_long_inv_freq(module, x.device) if use_long else module.original_inv_freq)

    return hook


def _long_inv_freq(module: Any, device: Any):
    """The long factors' frequencies, as transformers computes them (cached on the module as transformers does)."""
    cached = getattr(module, "long_inv_freq", None)
    if cached is None:
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        original = module.config.rope_parameters["original_max_position_embeddings"]
        cached, _ = ROPE_INIT_FUNCTIONS["longrope"](module.config, device, seq_len=original + 1)
        module.long_inv_freq = cached
    return cached.to(device)
