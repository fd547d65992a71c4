"""How the CLI leaves a process: normally, or — a launched rank whose process group is still up — through
os._exit with the same code, so that the interpreter's teardown cannot turn exit code 2 into an abort."""

from __future__ import annotations

import pytest

from lstune.cli import app


class _Exited(Exception):
    pass


@pytest.fixture
def hard_exits(monkeypatch):
    codes: list = []

    def fake_exit(code):
        codes.append(code)
        raise _Exited

    monkeypatch.setattr(app.os, "_exit", fake_exit)
    return codes


def test_a_rank_with_a_live_group_leaves_through_os_exit_with_the_same_code(monkeypatch, hard_exits, capsys):
    monkeypatch.setattr(app, "_launched_group_alive", lambda: True)
    with pytest.raises(_Exited):
        app.main(["train", "--no-such-flag"])  # a usage error: exit code 2
    assert hard_exits == [2] and "--no-such-flag" in capsys.readouterr().err

    def bug(*args, **kwargs):
        raise RuntimeError("a bug")

    monkeypatch.setattr(app, "app", bug)
    with pytest.raises(_Exited):
        app.main(["train"])
    assert hard_exits[-1] == 1 and "RuntimeError: a bug" in capsys.readouterr().err  # the traceback is kept


def test_a_plain_process_exits_normally(monkeypatch, hard_exits):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert not app._launched_group_alive()
    with pytest.raises(SystemExit) as exc:
        app.main(["train", "--no-such-flag"])
    assert exc.value.code == 2 and hard_exits == []


def _fails_with_a_data_error(*args, **kwargs):
    from lstune.errors import DataError

    raise DataError("the eval set has no token to train on")


def test_a_sigterm_while_an_error_propagates_does_not_hide_it(monkeypatch, capsys):
    """A launched rank's peers stop on the main process's error as it propagates, and torchrun then terminates the
    main process: its SIGTERM (Terminated, raised in a `finally` on the way out) must not replace the error."""
    from lstune.train.signals import Terminated

    def interrupted(*args, **kwargs):
        try:
            _fails_with_a_data_error()
        finally:
            raise Terminated("SIGTERM")

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(app, "app", interrupted)
    with pytest.raises(SystemExit) as exc:
        app.main(["train"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "no token to train on" in err and "SIGTERM" not in err


def test_a_sigterm_while_an_error_is_reported_is_ignored(monkeypatch, capsys):
    """Once the message is being written, a SIGTERM neither cuts it nor turns exit code 2 into 130."""
    import os
    import signal

    echo = app.typer.echo

    def terminated_while_echoing(message, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)  # handled (or ignored) before kill returns, in this main thread
        echo(message, **kwargs)

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(app, "app", _fails_with_a_data_error)
    monkeypatch.setattr(app.typer, "echo", terminated_while_echoing)
    with pytest.raises(SystemExit) as exc:
        app.main(["train"])
    assert exc.value.code == 2 and "no token to train on" in capsys.readouterr().err


def test_a_sigterm_while_a_lost_peer_propagates_leaves_quietly(monkeypatch, hard_exits, capsys):
    """A rank whose collective failed because the refusing rank left, then got the launcher's SIGTERM on the way out:
    it exits quietly as a lost peer (the refusing rank's message is the one the user reads), not with "SIGTERM
    received before training started" and exit 130."""
    from lstune.parallel.agent import LOST_PEER_EXIT
    from lstune.train.signals import Terminated

    def interrupted(*args, **kwargs):
        try:
            raise RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:1234")
        finally:
            raise Terminated("SIGTERM")

    monkeypatch.setattr(app, "_launched_group_alive", lambda: True)
    monkeypatch.setattr(app, "app", interrupted)
    with pytest.raises(_Exited):
        app.main(["train"])
    assert hard_exits[0] == LOST_PEER_EXIT and capsys.readouterr().err == ""  # the first os._exit ends it
