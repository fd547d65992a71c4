"""Child processes that end with their parent, however the parent ends.

A process killed with `kill -9` runs no handler, so it cannot stop its children: the launcher of `lstune train
--gpus N` and its ranks would train on (holding the output folder's lock, writing checkpoints), and a bench trial
would run on with nothing enforcing its time or memory limit. Linux lets a child ask the kernel for a signal when
its parent ends (prctl PR_SET_PDEATHSIG); `die_with_parent` asks for it, and a child whose parent had already gone
before it asked gets the signal at once. The setting survives exec, so one set between fork and exec
(`preexec`) covers a program the child runs.

Chain of a launched run: lstune → the launcher (torchrun's agent, `preexec` in `relaunch`: SIGTERM, which it
passes to the ranks, which save a checkpoint) → each rank (`die_with_launcher` at its start: SIGTERM, so a rank
whose launcher was killed still saves and exits). A bench trial gets SIGKILL: its result is of no use once the
bench is gone. A forked one is the forkserver's child, and the forkserver outlives the bench as long as a trial
holds its pipe, so the trial watches the bench itself (`end_with`).

Elsewhere than Linux this is a no-op (macOS has no such call); there, the children of a killed parent live on.
"""

from __future__ import annotations

import os
import select
import signal
import sys
import time
from typing import NoReturn

PR_SET_PDEATHSIG = 1
# Set by the launcher's process for the ranks it starts (the agent's pid), so a rank knows whose death to watch.
PARENT_ENV = "LSTUNE_PARENT_PID"


def quick_exit(code: int) -> NoReturn:
    """Exit with `code` without the interpreter's teardown, which — once torch, transformers and DeepSpeed are
    loaded — walks their ~600,000 objects with several full garbage collections: 2-20 s per process after a run's
    last line (measured on 2 busy cores), paid by every rank of a launched run and by its launcher, which waits for
    them. What a normal exit does that matters still runs, in its order: the other non-daemon threads are joined,
    the atexit handlers run (logging's flush of OUTPUT_DIR/lstune.log, weakref finalizers such as temporary
    folders' removal), the streams are flushed. Call it only once everything the process wrote is closed."""
    import atexit
    import threading

    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def die_with_parent(sig: int = signal.SIGTERM, parent: int | None = None) -> bool:
    """Ask the kernel to send `sig` to this process when its parent ends. If the parent (pid `parent`, when given)
    is no longer this process's parent, it ended already: send `sig` now. False where the platform cannot."""
    libc = _libc()
    return libc is not None and _ask(libc, sig, parent)


def _libc():
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    return ctypes.CDLL(None, use_errno=True)


def _ask(libc, sig: int, parent: int | None) -> bool:
    """The prctl call and the check, nothing else: run between fork and exec too, where no import may happen."""
    if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        return False
    if parent is not None and os.getppid() != parent:
        os.kill(os.getpid(), sig)
    return True


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def end_with(pid: int, sig: int = signal.SIGKILL) -> None:
    """End this process (by `sig`) when the process `pid` — not its parent — ends: a thread waits on it (a pidfd
    on Linux, so a reused pid is no confusion; elsewhere a poll each second). For a process forked from a server
    that outlives its clients (multiprocessing's forkserver lives as long as a child of it holds its pipe)."""
    import threading

    def watch() -> None:
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            os.kill(os.getpid(), sig)
            return
        except (AttributeError, OSError):  # no pidfd (not Linux, or a kernel before 5.3)
            while _alive(pid):
                time.sleep(1.0)
        else:
            select.select([fd], [], [])
        os.kill(os.getpid(), sig)

    threading.Thread(target=watch, name=f"end-with-{pid}", daemon=True).start()


def preexec(sig: int = signal.SIGTERM):
    """A `subprocess.Popen(preexec_fn=...)` that makes the child die with this process (by `sig`). The C library is
    loaded here, in the parent: the child, between fork and exec, only calls it (an import there could wait
    forever on a lock another thread of the parent held at the fork)."""
    libc, parent = _libc(), os.getpid()
    return (lambda: None) if libc is None else (lambda: _ask(libc, sig, parent))


def die_with_launcher() -> None:
    """In a rank started by lstune's launcher: end (SIGTERM: save, then exit) when the launcher ends."""
    parent = os.environ.pop(PARENT_ENV, None)  # not for this rank's own children (their parent is this rank)
    if parent and parent.isdigit() and "TORCHELASTIC_RUN_ID" in os.environ:  # started by the launcher's torchrun
        die_with_parent(signal.SIGTERM, int(parent))
