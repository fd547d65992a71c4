"""lstune.parallel.agent: how a launched run's ending becomes an exit code and, for a signal, one line."""

from __future__ import annotations

import signal

import pytest
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from lstune.parallel import agent


def _failed(**codes: int) -> ChildFailedError:
    """A ChildFailedError with one failure per `rankN=exitcode`, all in the same second."""
    failures = {}
    for name, code in codes.items():
        failure = ProcessFailure(local_rank=int(name[4:]), pid=100 + int(name[4:]), exitcode=code, error_file="")
        failure.timestamp = 1_000
        failures[int(name[4:])] = failure
    return ChildFailedError("lstune", failures)


def _run_raising(monkeypatch, exc) -> None:
    import torch.distributed.run

    def run(args):
        raise exc

    monkeypatch.setattr(torch.distributed.run, "run", run)


def test_a_process_that_said_why_gives_its_exit_code_and_nothing_more(monkeypatch, capsys):
    _run_raising(monkeypatch, _failed(rank1=-15, rank0=2))  # rank 0: bad data (its message); rank 1: stopped
    assert agent.main(["--standalone", "x"]) == 2
    assert capsys.readouterr().err == ""


def test_a_process_killed_by_a_signal_is_named_with_a_hint(monkeypatch, capsys):
    _run_raising(monkeypatch, _failed(rank0=-15))
    assert agent.main(["x"]) == 128 + 15
    err = capsys.readouterr().err
    assert "rank 0 was killed by SIGTERM" in err and "Traceback" not in err
    # The same second, both signalled: SIGTERM is the launcher's own stopping of the others, not the cause
    _run_raising(monkeypatch, _failed(rank0=-15, rank1=-9))
    assert agent.main(["x"]) == 137
    assert "rank 1 was killed by SIGKILL" in capsys.readouterr().err
    _run_raising(monkeypatch, _failed(rank0=-9, rank1=-6))
    assert agent.main(["x"]) == 137  # two other signals in the same second: the lower rank
    _run_raising(monkeypatch, _failed(rank1=-9))
    assert agent.main(["x"]) == 137
    assert "rank 1 was killed by SIGKILL (the kernel's out-of-memory killer" in capsys.readouterr().err


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 130), (signal.SIGHUP, 130)])
def test_a_stopped_launcher_exits_without_a_traceback(monkeypatch, capsys, sig, code):
    _run_raising(monkeypatch, SignalException("stopped", sigval=sig))
    assert agent.main(["x"]) == code
    assert capsys.readouterr().err == ""


def test_a_finished_run_exits_0(monkeypatch):
    import torch.distributed.run

    monkeypatch.setattr(torch.distributed.run, "run", lambda args: None)
    assert agent.main(["--standalone", "--nproc-per-node", "2", "--no-python", "true"]) == 0


def test_a_rank_that_lost_its_peer_yields_to_the_rank_that_was_killed(monkeypatch, capsys):
    # The survivor's collective failed first in time (it was quicker to exit than torchrun to notice the kill).
    failures = _failed(rank0=agent.LOST_PEER_EXIT, rank1=-9).failures
    failures[0].timestamp = 999
    _run_raising(monkeypatch, ChildFailedError("lstune", failures))
    assert agent.main(["x"]) == 137
    err = capsys.readouterr().err
    assert "rank 1 was killed by SIGKILL" in err and err.count("\n") == 1


def test_a_lost_peer_is_told_by_gloos_error_or_what_it_came_from():
    gloo = RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:1")
    assert agent.lost_a_peer(gloo)
    wrapped = ValueError("step failed")
    wrapped.__cause__ = gloo
    assert agent.lost_a_peer(wrapped)
    assert not agent.lost_a_peer(RuntimeError("CUDA out of memory"))


def test_the_launcher_tells_its_ranks_its_pid_and_no_one_else(monkeypatch):
    """The ranks (torchrun's children) read the launcher's pid to end with it; the variable must not outlive the
    launch in this process, where a later lstune command would take itself for a rank whose launcher died."""
    import os

    import torch.distributed.run

    from lstune.parallel.lifetime import PARENT_ENV

    seen = []
    monkeypatch.setattr(torch.distributed.run, "run", lambda args: seen.append(os.environ.get(PARENT_ENV)))
    assert agent.main(["--standalone", "--nproc-per-node", "2", "--no-python", "true"]) == 0
    assert seen == [str(os.getpid())] and PARENT_ENV not in os.environ


@pytest.mark.parametrize("program, code", [("true", 0), ("false", 1)])
def test_a_launch_leaves_no_folder_behind(monkeypatch, tmp_path, program, code):
    # torchrun's own default is a /tmp/torchelastic_* folder per run that nothing removes; the agent's is removed,
    # whether the processes succeed or fail (the failure, read from it, still gives the exit code).
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    argv = ["--standalone", "--nproc-per-node", "2", "--no-python", program]
    assert agent.main(argv) == code
    assert list(tmp_path.iterdir()) == []
