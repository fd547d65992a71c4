"""lstune.parallel.lifetime: a child ends with its parent (prctl PR_SET_PDEATHSIG), or with a process it watches."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signals are Linux's")


def _gone(pid: int, timeout: float = 20) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
        except OSError:
            return True
        if state == "Z":
            return True
        time.sleep(0.1)
    return False


def _middle(code: str) -> tuple[subprocess.Popen, int]:
    """A process running `code` (which starts a sleeping grandchild and prints its pid); (process, grandchild)."""
    middle = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": os.getcwd()})
    return middle, int(middle.stdout.readline())


@pytest.mark.parametrize("how", ["preexec", "end_with"])
def test_a_child_ends_when_its_parent_is_killed_with_9(how):
    if how == "preexec":
        code = """
            import signal, subprocess, sys, time
            from lstune.parallel.lifetime import preexec
            child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"],
                                     preexec_fn=preexec(signal.SIGKILL))
            print(child.pid, flush=True); time.sleep(300)
        """
    else:  # the grandchild watches the middle process by pid, as a forked bench trial watches the bench
        code = """
            import os, subprocess, sys, time
            watcher = "from lstune.parallel.lifetime import end_with; import time; end_with(%d); time.sleep(300)"
            child = subprocess.Popen([sys.executable, "-c", watcher % os.getpid()])
            print(child.pid, flush=True); time.sleep(300)
        """
    middle, grandchild = _middle(code)
    time.sleep(1.0)
    assert not _gone(grandchild, timeout=0.5)
    os.kill(middle.pid, signal.SIGKILL)
    middle.wait()
    assert _gone(grandchild)
