"""The output folder: checked before anything heavy, locked while a run uses it, never clobbered.

What lstune may delete or replace there is what it can prove it wrote: the names in the folder's run
record (`lstune-run.json`, updated before each new file or folder is created), and checkpoint folders
carrying lstune's manifest. Everything else is left alone, and a file or folder at one of lstune's own
names that the record does not list (a user's `config.yaml`) stops the run before anything is written.

- An existing, non-empty folder is an error unless the run resumes there or `--overwrite` is given.
- `--overwrite` removes the previous run's recorded files only once the new run has passed every check
  (data read, model loaded, engine built): a mistake in the new run leaves the old one intact.
- Symbolic links at lstune's names are refused: lstune never writes through a link to outside the folder.
- One run at a time (lstune.train.lock).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import shutil
import time
from contextlib import contextmanager
from pathlib import Path

from lstune.config.record import LOCK_NAME, LOG_FILE, RECORD_FORMAT, RECORD_NAME, holds_a_run, read_record
from lstune.config.schema import RunSection
from lstune.errors import UserError
from lstune.train.lock import OutputLock

FINAL_DIR = "final"
MERGED_DIR = "final-merged"
CONFIG_FILE = "config.yaml"
METRICS_FILE = "metrics.jsonl"
FIXED_NAMES = (CONFIG_FILE, METRICS_FILE, FINAL_DIR, MERGED_DIR, LOG_FILE, RECORD_NAME, LOCK_NAME)
_CHECKPOINT_RE = re.compile(r"^checkpoint-\d+$")

log = logging.getLogger(__name__)


def resolve_output_dir(run: RunSection, model_name: str) -> tuple[Path, Path | None]:
    """The output folder and the checkpoint to resume from; read-only, so every rank may call it."""
    from lstune.train.checkpoint import resolve_resume

    output_dir = Path(run.output_dir) if run.output_dir else default_output_dir(model_name)
    if run.resume:
        checkpoint = resolve_resume(output_dir, run.resume)
        _refuse_foreign_resume(output_dir, checkpoint, run.resume)
        return output_dir, checkpoint
    problems = run.output_dir_problems(output_dir)
    if problems:
        raise UserError(problems[0])
    return output_dir, None


def _refuse_foreign_resume(output_dir: Path, checkpoint: Path | None, resume: str) -> None:
    """`--resume OTHER_RUN/checkpoint-N --output-dir DIR` continues that run in DIR: DIR must not hold
    another run, whose metrics, checkpoints and final model the resumed run would replace."""
    if checkpoint is None or checkpoint.resolve().parent == output_dir.resolve():
        return
    if output_dir.exists() and holds_a_run(output_dir):
        raise UserError(
            f"--resume {resume!r} is a checkpoint of another folder, and --output-dir {str(output_dir)!r} already "
            "holds files, which the resumed run would replace. Give an empty or new --output-dir, or leave "
            f"--output-dir out to continue in {str(checkpoint.parent)!r}."
        )


def default_output_dir(model_name: str) -> Path:
    name = Path(model_name).name.lower().replace(":", "-")
    return Path("runs") / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"


class OutputFolder:
    """The main process's hold on the output folder: its lock, its record of lstune's own entries, and
    (with --overwrite) the previous run's entries, removed by `clear_previous` once the run is ready."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.lock = OutputLock(self.path)
        self.entries: set[str] = set()
        self.previous: set[str] = set()
        self._log_handler: logging.Handler | None = None

    def open(self, *, overwrite: bool) -> "OutputFolder":
        _make_writable(self.path)
        self.lock.acquire()
        try:
            _refuse_links(self.path)
            recorded = read_record(self.path)
            if overwrite:
                self.previous = recorded | _manifest_checkpoints(self.path)
            else:
                self.entries = recorded
            _refuse_foreign(self.path, self.entries | self.previous)
            self.claim(RECORD_NAME)
            self._attach_log_file()
            if self.lock.stale:
                log.warning("taking over the lock of %s: the run that held it (pid %s on %s) is no longer running",
                            self.path, self.lock.stale.get("pid"), self.lock.stale.get("host"))
        except BaseException:
            self.close()
            raise
        return self

    def claim(self, name: str) -> Path:
        """Record `name` as lstune's before it is created (so a crash between the two leaves it recorded)."""
        if name not in self.entries:
            self.entries.add(name)
            _write_record(self.path, self.entries | self.previous)
        return self.path / name

    def clear_previous(self) -> None:
        """--overwrite: remove the previous run's entries (recorded, or checkpoints with our manifest)."""
        for name in sorted(self.previous - self.entries - {RECORD_NAME, LOCK_NAME, LOG_FILE}):
            path = self.path / name
            if path.is_symlink() or not os.path.lexists(path):
                continue
            log.info("--overwrite: removing %s (written by the previous run)", path)
            shutil.rmtree(path) if path.is_dir() else path.unlink()
        self.previous = set()
        _write_record(self.path, self.entries)

    def close(self) -> None:
        if self._log_handler is not None:
            logging.getLogger("lstune").removeHandler(self._log_handler)
            self._log_handler.close()
            self._log_handler = None
        self.lock.release()

    def _attach_log_file(self) -> None:
        """OUTPUT_DIR/lstune.log: INFO and above of every lstune logger, appended run after run."""
        path = self.claim(LOG_FILE)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | getattr(os, "O_NOFOLLOW", 0), 0o644)
        handler = logging.StreamHandler(os.fdopen(fd, "a", encoding="utf-8"))
        handler.setLevel(logging.INFO)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        logger = logging.getLogger("lstune")
        logger.addHandler(handler)
        if logger.getEffectiveLevel() > logging.INFO:
            logger.setLevel(logging.INFO)
        self._log_handler = handler


def _make_writable(output_dir: Path) -> None:
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
        probe = output_dir / f".lstune-write-test-{os.getpid()}"
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        os.close(fd)
        probe.unlink()
    except OSError as exc:
        raise UserError(
            f"--output-dir {str(output_dir)!r} is not writable ({exc.strerror}); choose a folder you can write to."
        ) from None


def _refuse_links(output_dir: Path) -> None:
    links = sorted(
        entry.name for entry in output_dir.iterdir()
        if entry.is_symlink() and (entry.name in FIXED_NAMES or _CHECKPOINT_RE.match(entry.name))
    )
    if links:
        raise UserError(
            f"--output-dir {str(output_dir)!r} has symbolic links where lstune writes: {', '.join(links)}. lstune never "
            "writes through a link (it could point outside the folder); remove the links or choose another --output-dir."
        )


def _refuse_foreign(output_dir: Path, ours: set[str]) -> None:
    """A file at one of lstune's fixed names that lstune did not record is the user's: stop, touch nothing."""
    foreign = sorted(
        name for name in (CONFIG_FILE, METRICS_FILE, FINAL_DIR, MERGED_DIR, LOG_FILE)
        if os.path.lexists(output_dir / name) and name not in ours
    )
    if foreign:
        raise UserError(
            f"--output-dir {str(output_dir)!r} holds {', '.join(foreign)}, which lstune did not write there (its "
            f"{RECORD_NAME} does not list them) and would overwrite. Move them away or choose another --output-dir."
        )


def _manifest_checkpoints(output_dir: Path) -> set[str]:
    from lstune.train.checkpoint import MANIFEST_NAME

    return {
        entry.name for entry in output_dir.iterdir()
        if _CHECKPOINT_RE.match(entry.name) and not entry.is_symlink() and (entry / MANIFEST_NAME).is_file()
    }


def _write_record(output_dir: Path, names: set[str]) -> None:
    """Replace the record atomically (temp file + rename, which replaces a link instead of following it)."""
    body = json.dumps({"format": RECORD_FORMAT, "version": 1, "entries": sorted(names)}, indent=1)
    write_file_atomic(output_dir / RECORD_NAME, body)


def write_file_atomic(path: Path, text: str) -> None:
    """Write `text` to `path` via a temp file beside it and a rename: complete or absent, never through a
    link at `path`."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0), 0o644)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_config_snapshot(folder: OutputFolder, view: dict) -> None:
    import yaml

    from lstune import __version__

    header = f"# resolved config written by lstune {__version__}; rerun with: lstune train --config {CONFIG_FILE}\n"
    write_file_atomic(folder.claim(CONFIG_FILE), header + yaml.safe_dump(view, sort_keys=False))


_WRITE_FAILURES = ("No space left", "os error 28", "Disk quota exceeded", "os error 122",
                   "PytorchStreamWriter failed", "inline_container.cc")


@contextmanager
def write_errors(path: Path, *, kept: Path | None):
    """A full disk (or quota) while writing `path` becomes a message naming it, instead of torch's or
    safetensors' raw error; what was written before (`kept`) is intact, since every save is atomic."""
    try:
        yield
    except Exception as exc:
        if not _is_write_failure(exc):
            raise
        try:
            free = f"{shutil.disk_usage(path.parent).free / 2**20:,.0f} MiB free there now"
        except OSError:
            free = "free space unknown"
        before = f"{kept} is intact" if kept is not None else "no earlier checkpoint of this run exists"
        raise UserError(
            f"could not write {path}: no space left on its device (or the quota is reached; {free}). It was not "
            f"saved and nothing half-written was left; {before}. Free space (or lower --keep-last), then continue "
            "with --resume."
        ) from exc


def _is_write_failure(exc: BaseException) -> bool:
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    return any(marker in str(exc) for marker in _WRITE_FAILURES)
