"""Where a long step is: forward layer i/L, backward (with the layer being recomputed), optimizer, save.

When one step takes minutes, a bar that moves once per step says nothing for minutes. `PhaseTracker`
hooks each decoder layer's forward (a pre-hook: no tensor is touched) and tells `callback` the phase, at
most every `min_interval` seconds so that the display costs nothing measurable. Backward is reported as
one phase: the checkpointed recompute calls the layers' forward functions directly (no module hook fires),
and a per-layer backward hook would wrap every layer's outputs in autograd nodes for a progress display.
"""

from __future__ import annotations

import time
from typing import Callable


class PhaseTracker:
    def __init__(self, callback: Callable[[str], None], layers=None, *, min_interval: float = 0.5):
        self.callback = callback
        self.min_interval = min_interval
        self.phase = ""
        self.count = len(layers) if layers is not None else 0
        self._last = 0.0
        self._handles = [
            layer.register_forward_pre_hook(self._layer_hook(i + 1)) for i, layer in enumerate(layers or [])
        ]

    def set(self, phase: str) -> None:
        """Enter `phase`; always reported (phases change a few times per step)."""
        self.phase = phase
        self._report(phase, force=True)

    def _layer_hook(self, index: int):
        def hook(module, args):
            if self.phase in ("forward", "eval"):
                self._report(f"{self.phase} layer {index}/{self.count}")
        return hook

    def _report(self, text: str, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self._last >= self.min_interval:
            self._last = now
            self.callback(text)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
