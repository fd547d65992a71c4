"""Stop cleanly on SIGINT/SIGTERM: finish the current step, save a checkpoint, exit."""

from __future__ import annotations

import signal
import threading


class StopOnSignal:
    """Within the block, the first SIGINT/SIGTERM sets `requested` instead of killing the process; a
    second SIGINT raises KeyboardInterrupt at once (the user insists). Handlers are restored on exit."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self.requested = False
        self.signal_name = ""
        self._previous: dict[int, object] = {}

    def __enter__(self) -> "StopOnSignal":
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.requested = True
        self.signal_name = signal.Signals(signum).name

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
