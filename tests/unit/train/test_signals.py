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
