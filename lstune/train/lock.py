"""One run per output folder: a lock file naming the run that holds it.

`OUTPUT_DIR/.lstune.lock` holds the running run's pid, host, start time and command, and the process
keeps an exclusive `flock` on it for as long as it runs. A second run into the same folder fails to
take the flock and is refused with the first run's details. The kernel drops a flock when its process
dies, however it dies (kill -9 included), so a lock file left by a killed run is recognised as stale
(the flock is free), reported, and taken over: a crashed run never blocks its folder.

flock is advisory and per host: it serialises lstune runs, which all take it, on local file systems and
on NFSv4 (which maps it to its own byte-range locks); on file systems without working locks two hosts
could both take it, which is why the file also names the host.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
import sys
import time
from pathlib import Path

from lstune.config.record import LOCK_NAME
from lstune.errors import UserError


log = logging.getLogger(__name__)


class OutputLock:
    """Held from `acquire` until `release` (or the process's death)."""

    def __init__(self, output_dir: Path):
        self.path = Path(output_dir) / LOCK_NAME
        self._fd: int | None = None
        self.stale: dict = {}

    def acquire(self) -> "OutputLock":
        if self.path.is_symlink():
            raise UserError(f"{self.path} is a symbolic link; lstune never writes through links in its output "
                            "folder. Remove the link or choose another --output-dir.")
        fd = self._open_locked()
        self.stale = _read(fd)  # the record of a run that died holding the folder; reported by the caller
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(_me()).encode(), 0)
        os.fsync(fd)
        self._fd = fd
        return self

    def _open_locked(self) -> int:
        """The flocked descriptor of the file now at `path`: a run releasing the lock unlinks the file it
        locked, so a flock won on an unlinked file is retried on the new one."""
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read(fd)
                os.close(fd)
                raise UserError(_held_message(self.path.parent, holder)) from None
            try:
                if os.stat(self.path, follow_symlinks=False).st_ino == os.fstat(fd).st_ino:
                    return fd
            except FileNotFoundError:
                pass
            os.close(fd)

    def release(self) -> None:
        """Remove the file while still holding the flock, so no other run sees it half-released."""
        if self._fd is None:
            return
        try:
            self.path.unlink(missing_ok=True)
        finally:
            os.close(self._fd)
            self._fd = None


def _me() -> dict:
    return {"pid": os.getpid(), "host": socket.gethostname(), "started_unix": time.time(),
            "command": " ".join(["lstune", *sys.argv[1:]])[:500]}


def _read(fd: int) -> dict:
    try:
        data = json.loads(os.pread(fd, 65536, 0).decode("utf-8", "replace") or "{}")
    except json.JSONDecodeError:
        return {}
    return data if isinstance(data, dict) else {}


def _held_message(output_dir: Path, holder: dict) -> str:
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder["started_unix"])) \
        if isinstance(holder.get("started_unix"), (int, float)) else "an unknown time"
    return (
        f"--output-dir {str(output_dir)!r} is in use by another lstune run (pid {holder.get('pid', '?')} on "
        f"{holder.get('host', '?')}, started {since}: {holder.get('command', '?')}). Two runs in one folder "
        "would overwrite each other's checkpoints; wait for it to finish, stop it, or choose another --output-dir."
    )
