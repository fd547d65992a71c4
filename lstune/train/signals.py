"""Stop cleanly on SIGINT/SIGTERM: finish the current step, save a checkpoint, exit.

Outside the steps (loading before them; the plot, the summary and the process group's end after them) the
CLI's own SIGTERM handler stops the process; `newest_checkpoint` tells it what the run had saved by then.
"""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

# The newest checkpoint this process's run saved: the one record a signal outside the steps reads (the CLI's
# handler runs wherever the process happens to be, with no run object at hand).
_saved: dict[str, Path | None] = {"checkpoint": None}


def note_checkpoint(path: Path | None) -> None:
    """Record `path` as the run's newest checkpoint (None when a run starts)."""
    _saved["checkpoint"] = path


def newest_checkpoint() -> Path | None:
    return _saved["checkpoint"]


class StopOnSignal:
    """Within the block, the first SIGINT/SIGTERM sets `requested` instead of killing the process; a
    second SIGINT raises KeyboardInterrupt at once (the user insists). Handlers are restored on exit.

    A SIGINT within `REPEAT_S` of the first is the same Ctrl-C: under torchrun the terminal's reaches every
    process and torchrun passes its own on a moment later, which must not cut the checkpoint save short."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)
    REPEAT_S = 1.0

    def __init__(self):
        self.requested = False
        self.signal_name = ""
        self._previous: dict[int, object] = {}
        self._first_at: float | None = None

    def __enter__(self) -> "StopOnSignal":
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        now = time.monotonic()
        if self.requested:
            if signum == signal.SIGINT and now - self._first_at > self.REPEAT_S:
                raise KeyboardInterrupt
            return
        self.requested = True
        self.signal_name = signal.Signals(signum).name
        self._first_at = now

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
