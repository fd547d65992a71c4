"""Processes end with their parent, however it ends: `kill -9` of `lstune train --gpus N` or of `lstune bench`
leaves nothing running; a rank killed by a signal is one line naming it (not the survivor's gloo traceback); SIGHUP
stops a run as SIGTERM does (a checkpoint, then exit 130)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lstune.bench.runner import descendants
from tests.integration.conftest import REPO, TINY_MODEL, read_metrics

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signals are Linux's")


def _start(*args) -> subprocess.Popen:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(REPO)}
    return subprocess.Popen([sys.executable, "-m", "lstune", *map(str, args)], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for(predicate, process: subprocess.Popen, timeout: float = 240) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return
        if process.poll() is not None:
            raise AssertionError(f"ended early ({process.returncode}): {process.communicate()[1][-3000:]}")
        time.sleep(0.2)
    process.kill()
    raise AssertionError("timed out")


def _steps_logged(out: Path, n: int = 2):
    return lambda: (out / "metrics.jsonl").exists() and (out / "metrics.jsonl").read_text().count("\n") >= n


def _running(pids: list[int]) -> list[int]:
    """The pids of `pids` still running (not gone, not zombies)."""
    alive = []
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state != "Z":
            alive.append(pid)
    return alive


def _wait_gone(pids: list[int], timeout: float = 180) -> list[int]:
    deadline = time.time() + timeout
    while _running(pids) and time.time() < deadline:
        time.sleep(0.5)
    return _running(pids)


def _rank_pid(root: int, rank: int) -> int:
    for pid in descendants(root):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in environ and b"TORCHELASTIC_RUN_ID" in b"\0".join(environ):
            return pid
    raise AssertionError(f"no rank {rank} below {root}")


def _launched_run(tmp_path, text_data) -> tuple[subprocess.Popen, Path]:
    out = tmp_path / "run"
    process = _start("train", *TINY_MODEL, "--seq-len", "128", "--gpus", "2", "--data", text_data,
                     "--max-steps", "100000", "--output-dir", out)
    _wait_for(_steps_logged(out), process)
    return process, out


@pytest.mark.slow
def test_kill_9_of_a_launched_run_leaves_no_process_running(tmp_path, text_data):
    process, out = _launched_run(tmp_path, text_data)
    tree = descendants(process.pid)
    assert len(tree) >= 3  # the launcher and two ranks
    os.kill(process.pid, signal.SIGKILL)
    process.communicate(timeout=300)
    assert _wait_gone(tree) == []
    steps = len(read_metrics(out))
    assert (out / f"checkpoint-{steps}").is_dir()  # the ranks were stopped as by SIGTERM: they saved first


@pytest.mark.slow
def test_a_killed_rank_is_reported_in_one_line_naming_it(tmp_path, text_data):
    process, _ = _launched_run(tmp_path, text_data)
    os.kill(_rank_pid(process.pid, 1), signal.SIGKILL)
    _, err = process.communicate(timeout=240)
    assert process.returncode == 128 + signal.SIGKILL, err[-3000:]
    assert "rank 1 was killed by SIGKILL" in err
    assert "Traceback" not in err and "gloo" not in err.lower(), err[-3000:]


@pytest.mark.slow
def test_kill_9_of_the_bench_leaves_no_trial_running(tmp_path):
    out = tmp_path / "bench"
    process = _start("bench", "--model", "tiny-llama", "--seq-len", "256", "--rungs", "hf", "--warmup", "0",
                     "--steps", "1000000", "--trial-timeout", "3600", "--output-dir", out)
    trials = out / "trials"
    _wait_for(lambda: trials.is_dir() and any(trials.glob("trial-*.log")) and len(descendants(process.pid)) >= 2,
              process)
    time.sleep(5)  # the trial is training
    tree = descendants(process.pid)
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    assert _wait_gone(tree, timeout=60) == []


def test_sighup_saves_a_checkpoint_then_exits_like_sigterm(tmp_path, text_data):
    out = tmp_path / "run"
    process = _start("train", *TINY_MODEL, "--data", text_data, "--max-steps", "100000", "--output-dir", out)
    _wait_for(_steps_logged(out), process)
    process.send_signal(signal.SIGHUP)
    stdout, stderr = process.communicate(timeout=120)
    assert process.returncode == 130, stderr[-3000:]
    steps = len(read_metrics(out))
    assert (out / f"checkpoint-{steps}").is_dir(), sorted(os.listdir(out))
    assert "SIGHUP" in stdout + stderr
