"""Write a folder so that it appears complete or not at all."""

from __future__ import annotations

import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO, Callable, Iterator


@contextmanager
def atomic_dir(target: Path) -> Iterator[Path]:
    """Yield a temp folder beside `target`; on success it replaces `target` by rename (an old `target`
    is moved aside first and removed only once the new one is in place). On error the temp folder is
    removed and `target` is untouched."""
    target = Path(target)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{target.name}-", dir=target.parent))
    try:
        yield tmp
        apply_umask(tmp)
        _fsync_tree(tmp)
        old = None
        if target.exists():
            old = target.with_name(f".tmp-old-{target.name}-{os.getpid()}")
            os.rename(target, old)
        os.rename(tmp, target)
        fsync_dir(target.parent)
        if old is not None:
            shutil.rmtree(old)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def current_umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def apply_umask(root: Path) -> None:
    """Give a tree lstune wrote the modes the user's umask asks for: temp folders (0700) and some writers
    (safetensors: 0600) create private files, which would hide the outputs from the user's group."""
    mask = current_umask()
    os.chmod(root, 0o777 & ~mask)
    for path in Path(root).rglob("*"):
        if path.is_symlink():
            continue
        os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~mask)


def _fsync_tree(root: Path) -> None:
    for path in root.rglob("*"):
        if path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())
    fsync_dir(root)


def fsync_dir(path: Path) -> None:
    """Make a folder's entries (new files, renames) durable; only POSIX can open a folder to fsync it."""
    if os.name != "posix":
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_new(path: Path, write: Callable[[BinaryIO], None]) -> Path:
    """Write `path` through a temporary file beside it, created exclusively (it can be no one else's), then a rename,
    which replaces a link at `path` instead of writing through it: `path` is complete or absent."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~current_umask())  # mkstemp's files are private (0600); the outputs are not
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def write_text_new(path: Path, text: str) -> Path:
    return write_new(path, lambda f: f.write(text.encode("utf-8")))
