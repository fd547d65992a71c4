"""Handing `position_ids` on where a model's own code drops them: one mechanism for every such model.

lstune's attention takes documents (and Ulysses its gathered positions, FPDT its per-chunk cut) from the
`position_ids` each attention call gets. A few models' code does not pass them down: GraniteMoeHybrid's decoder layers
get none from its body (`models.attention.POSITIONS_DROPPED`), Llama-4's attention none from its decoder layer
(`models.llama4`). Forward pre-hooks on the model instance hand them on; removing the hooks undoes it.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable


def hand_on_positions(source: Any, targets: Any) -> list[Callable[[], None]]:
    """Forward pre-hooks that record `position_ids` at each call of `source` (a keyword, or the positional argument of
    that name) and add them to the keyword arguments of each module in `targets` (called within it) that is not given
    them. An activation checkpoint's recompute calls a target again with the keywords recorded at its first call.
    Returns the hooks' removers."""
    index = _argument_index(source.forward, "position_ids")
    current: dict[str, Any] = {}

    def record(module, args, kwargs):
        given = args[index] if index is not None and index < len(args) else None
        current["position_ids"] = kwargs.get("position_ids", given)

    def add(module, args, kwargs):
        if kwargs.get("position_ids") is None and current.get("position_ids") is not None:
            return args, {**kwargs, "position_ids": current["position_ids"]}
        return None

    hooks = [source.register_forward_pre_hook(record, with_kwargs=True)]
    hooks += [target.register_forward_pre_hook(add, with_kwargs=True) for target in targets]
    return [hook.remove for hook in hooks]


def _argument_index(function: Callable, name: str) -> int | None:
    """The position of argument `name` among `function`'s positional ones; None if it cannot be passed by position."""
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):  # no signature to read: keywords only
        return None
    positional = [p.name for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return positional.index(name) if name in positional else None
