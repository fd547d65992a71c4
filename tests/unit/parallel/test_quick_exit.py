"""lstune.parallel.lifetime.quick_exit: a normal exit's useful steps (threads joined, atexit handlers, streams
flushed) in their order, the exit code kept, the interpreter's teardown skipped."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

_PROGRAM = """
    import atexit, sys, threading, time
    from lstune.parallel.lifetime import quick_exit

    class Torn:
        def __del__(self):
            print("teardown ran", flush=True)

    keep = Torn()  # a module global: only the interpreter's teardown would collect it
    worker = threading.Thread(target=lambda: (time.sleep(0.3), print("thread finished")))
    worker.start()
    atexit.register(lambda: print("atexit ran"))
    sys.stdout.write("unflushed line")  # no newline: still in the buffer at exit
    quick_exit(CODE)
"""


def _run(code: int) -> subprocess.CompletedProcess:
    program = textwrap.dedent(_PROGRAM).replace("CODE", str(code))
    return subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": os.getcwd()})


def test_quick_exit_joins_threads_runs_atexit_flushes_and_keeps_the_code():
    proc = _run(3)
    assert proc.returncode == 3, proc.stderr
    assert proc.stdout == "unflushed linethread finished\natexit ran\n", proc.stdout
    assert "teardown ran" not in proc.stdout


def test_quick_exit_with_code_zero():
    proc = _run(0)
    assert proc.returncode == 0 and "atexit ran" in proc.stdout, proc.stderr
