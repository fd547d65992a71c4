"""Stop cleanly on SIGINT/SIGTERM/SIGHUP: finish the current step, save a checkpoint, exit.

SIGHUP (the terminal or the ssh session that started the run closed) is a stop like SIGTERM: by default it would
end the process at once, without the checkpoint.

Outside the steps (loading before them; the plot, the summary and the process group's end after them) the
CLI's own SIGTERM handler stops the process; `newest_checkpoint` tells it what the run had saved by then.
"""

from __future__ import annotations

import signal
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

# What a signal outside the steps needs, with no run object at hand (the CLI's handler runs wherever the process
# happens to be): the newest checkpoint this process's run saved, the SIGTERM that came (kept as well as raised,
# see `on_sigterm`), and whether it is being held (`holding` > 0: kept only).
_state: dict[str, Any] = {"checkpoint": None, "signal": None, "holding": 0}

# The signals that stop a run outside the steps (the CLI's handler, `on_sigterm`), as SIGINT does within them.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


class Terminated(BaseException):
    """SIGTERM outside the training steps (whose own handler saves a checkpoint first). A BaseException that is not
    KeyboardInterrupt, so that no library's `except Exception` swallows it and typer does not turn it into a silent
    exit."""


def on_sigterm(signum, frame) -> None:
    """The CLI's SIGTERM handler outside the steps: raise Terminated where the process is. The signal is also kept,
    because the exception can be lost: raised while Python compiles a module's source (no .pyc: a fresh install,
    PYTHONDONTWRITEBYTECODE, a read-only site-packages), compile() clears it and the import goes on (seen on
    CPython 3.11), so the run would train as if no signal had come. `raise_if_terminated` raises it again."""
    name = signal.Signals(signum).name
    _state["signal"] = name
    if not _state["holding"]:
        raise Terminated(name)


@contextmanager
def holding_sigterm() -> Iterator[None]:
    """A SIGTERM within the block is kept, not raised, until the caller's `raise_if_terminated` after it: for a step
    that must not stop half-way, such as locking the output folder and handing it to the code that unlocks it.
    (Blocking the signal with pthread_sigmask would not do: another thread takes it, and Python runs the handler
    on the main thread all the same.)"""
    _state["holding"] += 1
    try:
        yield
    finally:
        _state["holding"] -= 1


def raise_if_terminated() -> None:
    """Raise Terminated if a SIGTERM came (and its exception was lost) since `reset`."""
    if _state["signal"] is not None:
        raise Terminated(_state["signal"])


def reset() -> None:
    """A run starts: no checkpoint saved, no SIGTERM pending."""
    _state.update(checkpoint=None, signal=None)


def note_checkpoint(path: Path) -> None:
    """Record `path` as the run's newest checkpoint."""
    _state["checkpoint"] = path


def newest_checkpoint() -> Path | None:
    return _state["checkpoint"]


class StopOnSignal:
    """Within the block, the first SIGINT/SIGTERM sets `requested` instead of killing the process; a
    second SIGINT raises KeyboardInterrupt at once (the user insists). Handlers are restored on exit.

    A SIGINT within `REPEAT_S` of the first is the same Ctrl-C: under torchrun the terminal's reaches every
    process and torchrun passes its own on a moment later, which must not cut the checkpoint save short."""

    SIGNALS = (signal.SIGINT, *STOP_SIGNALS)
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
