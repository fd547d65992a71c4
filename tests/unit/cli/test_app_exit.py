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
