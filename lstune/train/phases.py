"""Where a long step is: forward layer i/L, backward layer i/L (L down to 1), optimizer, save.

When one step takes minutes, a bar that moves once per step says nothing for minutes. `PhaseTracker`
hooks each decoder layer and tells `callback` the phase, at most every `min_interval` seconds so that
the display costs nothing measurable:

- forward: a forward pre-hook per layer (no tensor is touched);
- backward: in the forward, a forward hook registers a gradient hook on the layer's output tensor
  (`Tensor.register_hook`: a callback on the existing autograd node, no new node, no copy). Autograd calls
  it when that output's gradient is ready, which is when the layer's own backward (with checkpointing, its
  recompute first) begins, so layers report L, L-1, …, 1. The hook only reads a clock and returns None
  (the gradient is left as it is) and never synchronises a CUDA stream. The checkpointed recompute calls
  the layer's forward function directly, so neither hook fires twice.

`remove()` takes every hook off; gradient hooks registered on a step's tensors die with that step's graph.
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
        self._handles = []
        for i, layer in enumerate(layers or []):
            self._handles.append(layer.register_forward_pre_hook(self._layer_hook(i + 1)))
            self._handles.append(layer.register_forward_hook(self._output_hook(i + 1)))

    def set(self, phase: str) -> None:
        """Enter `phase`; always reported (phases change a few times per step)."""
        self.phase = phase
        self._report(phase, force=True)

    def _layer_hook(self, index: int):
        def hook(module, args):
            if self.phase in ("forward", "eval"):
                self._report(f"{self.phase} layer {index}/{self.count}")
        return hook

    def _output_hook(self, index: int):
        def on_gradient(grad):
            if self.phase == "backward" and self._handles:
                self._report(f"backward layer {index}/{self.count}")

        def hook(module, args, output):
            hidden = output[0] if isinstance(output, (tuple, list)) else output
            if self.phase == "forward" and getattr(hidden, "requires_grad", False):
                hidden.register_hook(on_gradient)
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
