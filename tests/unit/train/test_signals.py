"""StopOnSignal: a signal asks for a stop; Ctrl-C twice insists — but not the same Ctrl-C delivered twice."""

from __future__ import annotations

import os
import signal
import time

import pytest

from lstune.train.signals import StopOnSignal


def _send(sig: int) -> None:
    os.kill(os.getpid(), sig)
    time.sleep(0.01)  # the handler runs in the main thread at its next instruction


def test_the_first_signal_asks_for_a_stop_and_handlers_are_restored():
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    with StopOnSignal() as stop:
        assert not stop.requested
        _send(signal.SIGTERM)
        assert stop.requested and stop.signal_name == "SIGTERM"
        _send(signal.SIGTERM)  # a repeated SIGTERM only asks again
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before


def test_a_second_ctrl_c_within_a_second_is_the_same_one_later_it_insists(monkeypatch):
    """torchrun passes the terminal's Ctrl-C on to processes that got it already: that copy must not cut the
    checkpoint save short; a Ctrl-C pressed again later stops at once."""
    monkeypatch.setattr(StopOnSignal, "REPEAT_S", 0.3)
    with StopOnSignal() as stop:
        _send(signal.SIGINT)
        _send(signal.SIGINT)
        assert stop.requested and stop.signal_name == "SIGINT"
        time.sleep(0.4)
        with pytest.raises(KeyboardInterrupt):
            _send(signal.SIGINT)


def test_a_sigterm_is_kept_while_held_and_raised_after_and_kept_when_its_exception_is_lost():
    """Outside the steps the CLI's handler raises Terminated; while the output folder is being locked it only keeps
    the signal (raised by raise_if_terminated once the lock is in hand), and a kept signal survives an exception
    that something swallowed (compile() does, while Python compiles a module)."""
    from lstune.train.signals import Terminated, holding_sigterm, on_sigterm, raise_if_terminated, reset

    reset()
    raise_if_terminated()  # nothing pending
    with holding_sigterm():
        on_sigterm(signal.SIGTERM, None)  # kept, not raised
    with pytest.raises(Terminated, match="SIGTERM"):
        raise_if_terminated()
    reset()
    with pytest.raises(Terminated):
        on_sigterm(signal.SIGTERM, None)
    with pytest.raises(Terminated):
        raise_if_terminated()  # still pending if that exception was lost
    reset()
    raise_if_terminated()
