"""LongRoPE with --pack: each packed document gets the factors of its own length, as the model run on it alone.

LongRoPE (Phi-3's `rope_type: longrope`) picks its frequencies each forward from the longest position it sees
(transformers' `dynamic_rope_update`): the long factors when it passes `original_max_position_embeddings`, the
short ones otherwise. A packed row (positions restarting at 0 at each document, lstune/data/batch.py) holding a
document past the original context and one within it gets the long factors everywhere, while the model run on
the short document alone gives it the short ones: loss and gradients off, silently.

`per_document_longrope` adds a forward hook to each LongRoPE rotary module that, on a row mixing both, recomputes
the cos/sin of the tokens of short documents with the short factors (transformers' own formula: positions x
frequencies, duplicated, times `attention_scaling`), so every token has what the model gives it on its document
alone. A document is a run of positions from 0 (or any restart); its length is its largest position + 1, the
length transformers reads. One process only: under sequence parallelism a document's length is spread over the
ranks, and `--pack` past the original context is refused there (lstune.models.rope.check_length_dependent_rope).
Instance-level and undoable (`RopeDocumentsHandle.undo`).
"""

from __future__ import annotations

from typing import Any


class RopeDocumentsHandle:
    def __init__(self, hooks: list[Any]):
        self._hooks = hooks

    @property
    def modules(self) -> int:
        return len(self._hooks)

    def undo(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []


def per_document_longrope(model: Any) -> RopeDocumentsHandle:
    """Hook every LongRoPE rotary embedding of `model` to give each packed document its own length's factors."""
    hooks = [module.register_forward_hook(_per_document, with_kwargs=True)
             for module in model.modules()
             if getattr(module, "rope_type", None) == "longrope" and hasattr(module, "original_inv_freq")]
    return RopeDocumentsHandle(hooks)


def document_lengths(position_ids: Any) -> Any:
    """For each token, the length of its document: the largest position of its run (a run starts at the row's
    first token and wherever the position does not grow), plus 1."""
    import torch

    starts = torch.ones_like(position_ids, dtype=torch.bool)
    starts[..., 1:] = position_ids[..., 1:] <= position_ids[..., :-1]
    run = torch.cumsum(starts.to(torch.int64), dim=-1) - 1
    longest = torch.zeros_like(position_ids).scatter_reduce(-1, run, position_ids, reduce="amax", include_self=False)
    return longest.gather(-1, run) + 1


def _per_document(module: Any, args: tuple, kwargs: dict, output: Any) -> Any:
    import torch

    x = args[0] if args else kwargs["x"]
    position_ids = args[1] if len(args) > 1 else kwargs["position_ids"]
    original = module.config.rope_parameters["original_max_position_embeddings"]
    short = document_lengths(position_ids) <= original
    if bool(short.all()) or not bool(short.any()):
        return output  # one kind of document: transformers chose as it does for each alone
    cos, sin = output
    freqs = position_ids[..., None].float() * module.original_inv_freq.to(device=x.device, dtype=torch.float)
    emb = torch.cat((freqs, freqs), dim=-1)
    keep = short[..., None]
    return (torch.where(keep, (emb.cos() * module.attention_scaling).to(cos.dtype), cos),
            torch.where(keep, (emb.sin() * module.attention_scaling).to(sin.dtype), sin))
