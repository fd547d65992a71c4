"""`python -m lstune.parallel.agent TORCHRUN-ARGS`: torchrun for `lstune train --gpus N`, ending in one line.

torchrun (torch.distributed.run) ends a run in which a process failed with a Python traceback of its own and a
framed report, even when the process has already said why in one line (bad data: lstune's message, exit code
2), and a Ctrl-C ends it with a traceback too. This runs torchrun's own `run` with its arguments as torchrun's
`main` does, and turns its ending into an exit code: the first failed process's (128 + the signal's number for
one killed by a signal, with a line naming the signal, since such a process could not say anything itself), or
130 when the launcher itself was stopped by a signal. The launcher's log lines (which process it sends a signal
to, which failed with which code: all said here or by the process) are left out; `--debug` keeps them.
"""

from __future__ import annotations

import logging
import signal
import sys

# A process killed by one of these most often met the out-of-memory killer or a kill -9; say where to look.
_HINTS = {signal.SIGKILL: "the kernel's out-of-memory killer (dmesg says) or a kill -9",
          signal.SIGSEGV: "a crash in native code (its output above may say more)",
          signal.SIGABRT: "a crash in native code (its output above may say more)",
          signal.SIGBUS: "a crash in native code; also a full /dev/shm"}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    if not debug:
        _quiet_launcher_logs()
    try:
        run(parse_args(argv))
    except ChildFailedError as exc:
        return _failure_code(exc)
    except SignalException as exc:
        # The launcher got SIGINT/SIGTERM and passed it to the processes, which save a checkpoint and say so.
        return 130 if exc.sigval in (signal.SIGINT, signal.SIGTERM) else 128 + int(exc.sigval)
    return 0


def _failure_code(exc) -> int:
    """The first failed process's exit code; a line for one a signal killed, which could not say why itself.
    Failures are timed to the second: within the first second, a process that exited on its own (with its
    message) comes before one killed by a signal (most likely the launcher's, stopping the others)."""
    rank, failure = min(exc.failures.items(), key=lambda item: (item[1].timestamp, item[1].exitcode < 0, item[0]))
    code = failure.exitcode
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
    sys.exit(main())
