"""The trial runner's limits: a process tree past its time or host-memory limit is killed (all of it, by pid) and
recorded as such; a trial whose own peak RSS passed the cap is not counted as fitting."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from lstune.bench.runner import Limits, TrialRunner, _Process, descendants, tree_rss

# A parent that starts a child, both sleeping: a tree of two processes.
TREE = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); time.sleep(60)"


class _Tree(_Process):
    def __init__(self):
        self.popen = subprocess.Popen([sys.executable, "-c", TREE])
        self.pid = self.popen.pid

    def exit_code(self):
        return self.popen.poll()

    def wait(self):
        self.popen.wait(timeout=30)


class _Job:
    id, kind, rung, seq_len, purpose, processes = 1, "step", "hf", 256, "search", 1


def _children_of(tree: _Tree, wait_s: float = 10.0) -> list[int]:
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        found = descendants(tree.pid)
        if found:
            return found
        time.sleep(0.05)
    raise AssertionError("the child process did not start")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize("limits, outcome", [(Limits(0.3, None), "timeout"), (Limits(600, 1), "host-oom")])
def test_a_trial_past_its_limit_is_killed_with_its_children(tmp_path: Path, limits, outcome):
    tree = _Tree()
    children = _children_of(tree)
    assert tree_rss(tree.pid) > 0
    stopped, peak = TrialRunner(limits, tmp_path, cuda=False)._watch(tree, _Job(), time.monotonic())
    assert stopped["outcome"] == outcome and peak > 0
    time.sleep(0.2)
    assert not _alive(tree.pid) and not any(_alive(pid) for pid in children)


def test_a_finished_trial_whose_peak_passed_the_cap_does_not_fit(tmp_path: Path):
    runner = TrialRunner(Limits(600, 100 * 2**20), tmp_path, cuda=False)
    record = {"outcome": "ok", "peak_rss": 150 * 2**20, "peak_rss_sampled": 90 * 2**20}
    runner._check_cap(record)
    assert record["outcome"] == "host-oom" and "--max-host-mem" in record["error"]
    under = {"outcome": "ok", "peak_rss": 50 * 2**20, "peak_rss_sampled": 60 * 2**20}
    runner._check_cap(under)
    assert under["outcome"] == "ok"


def test_a_process_that_is_gone_has_no_memory_and_no_children():
    done = subprocess.Popen([sys.executable, "-c", "pass"])
    done.wait(timeout=30)
    assert tree_rss(done.pid) == 0 and descendants(done.pid) == []


def test_the_forkserver_preload_never_imports_bitsandbytes():
    """bitsandbytes' import initialises CUDA (it reads each GPU's compute capability), after which no forked trial
    can use the device: for trials on CUDA the forkserver's preload must not reach it (peft does, where it is
    installed)."""
    pytest.importorskip("bitsandbytes")
    from lstune.bench.runner import preload_modules

    modules = preload_modules(cuda=True)
    assert "peft" not in modules and "torch" in modules
    code = f"import importlib, sys\nfor m in {modules!r}: importlib.import_module(m)\nprint('bitsandbytes' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False"


def test_the_forkserver_preloads_peft_without_bitsandbytes_or_cuda(monkeypatch):
    import importlib.util

    from lstune.bench.runner import PRELOAD, preload_modules

    assert preload_modules(cuda=False) == PRELOAD  # no device to initialise: the fast start stays
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "bitsandbytes" else real(name, *a))
    assert preload_modules(cuda=True) == PRELOAD
