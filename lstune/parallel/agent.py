"""`python -m lstune.parallel.agent TORCHRUN-ARGS`: torchrun for `lstune train --gpus N`, ending in one line.

torchrun (torch.distributed.run) ends a run in which a process failed with a Python traceback of its own and a
framed report, even when the process has already said why in one line (bad data: lstune's message, exit code
2), and a Ctrl-C ends it with a traceback too. This runs torchrun's own `run` with its arguments as torchrun's
`main` does, and turns its ending into an exit code: the first failed process's (128 + the signal's number for
one killed by a signal, with a line naming the signal, since such a process could not say anything itself), or
130 when the launcher itself was stopped by a signal. A rank whose collective failed because another process went
away (`lost_a_peer`: gloo's "Connection closed by peer") exits quietly with LOST_PEER_EXIT, so the process that
went away — a rank killed by a signal — is the one line reported, not the survivor's traceback. The launcher's log lines (which process it sends a signal
to, which failed with which code: all said here or by the process) are left out; `--debug` keeps them.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import sys
import tempfile

# A process killed by one of these most often met the out-of-memory killer or a kill -9; say where to look.
_HINTS = {signal.SIGKILL: "the kernel's out-of-memory killer (dmesg says) or a kill -9",
          signal.SIGSEGV: "a crash in native code (its output above may say more)",
          signal.SIGABRT: "a crash in native code (its output above may say more)",
          signal.SIGBUS: "a crash in native code; also a full /dev/shm"}


# The exit code of a rank that stopped because another process of the run went away (its collective failed with
# "Connection closed by peer" or the like): it says nothing, and the process that went away is reported instead.
LOST_PEER_EXIT = 75

# What gloo and NCCL say in the error of a collective whose peer process has gone.
_LOST_PEER_MARKERS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Socket Timeout",
                      "remote process exited", "NCCL communicator was aborted", "Connection refused")


def lost_a_peer(exc: BaseException) -> bool:
    """`exc` (or one it came from) is a collective's failure because another process of the run went away."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, RuntimeError) and any(marker in str(exc) for marker in _LOST_PEER_MARKERS):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    from lstune.parallel.lifetime import PARENT_ENV

    os.environ[PARENT_ENV] = str(os.getpid())  # the ranks end with this launcher (lstune.parallel.lifetime)
    try:
        return _run(argv, debug)
    finally:
        os.environ.pop(PARENT_ENV, None)


def _run(argv: list[str], debug: bool) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    if not debug:
        _quiet_launcher_logs()
    log_dir = None
    if not any(arg.split("=")[0] in ("--log-dir", "--log_dir") for arg in argv):
        log_dir = _launch_log_dir()
        argv = ["--log-dir", log_dir, *argv]
    try:
        run(parse_args(argv))
    except ChildFailedError as exc:
        return _failure_code(exc)
    except SignalException as exc:
        # The launcher got SIGINT/SIGTERM and passed it to the processes, which save a checkpoint and say so.
        return 130 if exc.sigval in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP) else 128 + int(exc.sigval)
    finally:
        if log_dir is not None:
            shutil.rmtree(log_dir, ignore_errors=True)
    return 0


def _launch_log_dir() -> str:
    """A folder of lstune's own for torchrun's per-process files (error.json of a failed process), removed when the
    run ends. torchrun's default is a fresh /tmp/torchelastic_* folder per run that nothing removes: a machine
    that ran the test suite once had ~500 of them. The failures are read into the exception before it is raised,
    so nothing is lost by removing it."""
    return tempfile.mkdtemp(prefix="lstune-launch-")


def _failure_code(exc) -> int:
    """The first failed process's exit code; a line for one a signal killed, which could not say why itself.
    Failures are timed to the second: within the first second, a process that exited on its own (with its
    message) comes before one killed by a signal, and one killed by another signal before one killed by SIGTERM —
    the launcher's, stopping the others once it saw the first (a full CI run of 2026-11-28 named rank 0's SIGTERM
    where the test had killed rank 1 with SIGKILL, both recorded in the same second)."""
    rank, failure = min(exc.failures.items(), key=lambda item: (
        item[1].exitcode == LOST_PEER_EXIT, item[1].timestamp, item[1].exitcode < 0,
        item[1].exitcode == -signal.SIGTERM, item[0]))
    code = failure.exitcode
    if code == LOST_PEER_EXIT:
        print(f"lstune: the process of rank {rank} lost contact with the others (a process of the run went away "
              "without an error of its own); the other processes were stopped.", file=sys.stderr)
        return 1
    if code >= 0:
        return code
    name = failure.signal_name()
    hint = _HINTS.get(-code)
    print(f"lstune: the process of rank {rank} was killed by {name}" + (f" ({hint})" if hint else "")
          + "; the other processes were stopped.", file=sys.stderr)
    return 128 - code


def _quiet_launcher_logs() -> None:
    """torch.distributed.elastic's loggers (each its own level, set when created): silent but for the critical."""
    import torch.distributed.elastic  # noqa: F401 - creates the loggers

    for name in list(logging.Logger.manager.loggerDict):
        if name.startswith("torch.distributed.elastic") or name.startswith("torch.distributed.launcher"):
            logging.getLogger(name).setLevel(logging.CRITICAL)


if __name__ == "__main__":
    from lstune.parallel.lifetime import quick_exit

    quick_exit(main())  # torchrun loaded torch: its teardown would only delay lstune's own exit
