"""Reversible, logged replacement of one module instance's `forward`.

lstune never patches classes or anything at import time: each technique swaps the `forward` of the
module *instances* it applies to (an instance attribute shadows the class method), logs it on the
"lstune" logger and returns an undo. State-dict keys and the module tree stay as Hugging Face built
them, so checkpoints saved with the techniques on load without them.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from torch import nn

logger = logging.getLogger("lstune")

Undo = Callable[[], None]


def patch_forward(module: "nn.Module", new_forward: Callable, *, what: str) -> Undo:
    """Make `module(...)` run `new_forward`; the returned undo restores exactly what was there before."""
    had_own = "forward" in vars(module)
    previous = vars(module).get("forward")
    module.forward = new_forward
    logger.debug("patched %s.forward (%s)", type(module).__name__, what)

    def undo() -> None:
        if had_own:
            module.forward = previous
        else:
            vars(module).pop("forward", None)
        logger.debug("restored %s.forward (%s)", type(module).__name__, what)

    return undo


def run_undos(undos: list[Undo]) -> None:
    """Undo patches in reverse order of application, emptying the list."""
    while undos:
        undos.pop()()
