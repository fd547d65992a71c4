"""Reversible, logged replacement of one module instance's `forward` (or another instance attribute).

lstune never patches classes or anything at import time: each technique swaps the `forward` of the
module *instances* it applies to (an instance attribute shadows the class method), logs it on the
"lstune" logger and returns an undo. State-dict keys and the module tree stay as Hugging Face built
them, so checkpoints saved with the techniques on load without them.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from torch import nn

logger = logging.getLogger("lstune")

Undo = Callable[[], None]


def patch_forward(module: "nn.Module", new_forward: Callable, *, what: str) -> Undo:
    """Make `module(...)` run `new_forward`; the returned undo restores exactly what was there before."""
    return patch_attribute(module, "forward", new_forward, what=what)


def patch_attribute(owner: Any, name: str, value: Any, *, what: str) -> Undo:
    """Set `owner.name` on the instance (shadowing its class's); the returned undo restores exactly what was there
    before (the instance's own value, or none)."""
    had_own = name in vars(owner)
    previous = vars(owner).get(name)
    setattr(owner, name, value)
    logger.debug("patched %s.%s (%s)", type(owner).__name__, name, what)

    def undo() -> None:
        if had_own:
            setattr(owner, name, previous)
        else:
            vars(owner).pop(name, None)
        logger.debug("restored %s.%s (%s)", type(owner).__name__, name, what)

    return undo


class FusedNorm:
    """Forward of a norm fused into a tiled or chunked block (mini-sequence, chunked attention, the loss head's tiles):
    an identity when its layer (or the body) calls it, the norm itself when the block calls it through `FusedNorm.call`
    on a tile or chunk.

    The block calls the module, not its saved forward, so the module's hooks fire as for any call: DeepSpeed ZeRO-3
    gathers the norm's partitioned weight there (a saved forward would meet the empty partition)."""

    def __init__(self, forward: Callable):
        self.forward, self.inside = forward, False

    def __call__(self, hidden_states: Any, *args: Any, **kwargs: Any) -> Any:
        return self.forward(hidden_states, *args, **kwargs) if self.inside else hidden_states

    @staticmethod
    def install(norm: "nn.Module", *, what: str) -> Undo:
        return patch_forward(norm, FusedNorm(norm.forward), what=what)

    @staticmethod
    def installed(norm: "nn.Module") -> bool:
        return isinstance(vars(norm).get("forward"), FusedNorm)

    @staticmethod
    def call(norm: "nn.Module", hidden_states: Any) -> Any:
        patched: FusedNorm = vars(norm)["forward"]
        patched.inside = True
        try:
            return norm(hidden_states)
        finally:
            patched.inside = False


def run_undos(undos: list[Undo]) -> None:
    """Undo patches in reverse order of application, emptying the list."""
    while undos:
        undos.pop()()
