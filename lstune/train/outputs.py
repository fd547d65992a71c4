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
from lstune.train.atomic import write_text_new
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

    if run.output_dir:
        output_dir = Path(run.output_dir).expanduser()
    else:  # `--resume PATH` alone continues in that run's folder; otherwise a new folder under runs/
        output_dir = _resumed_run_folder(run.resume) or default_output_dir(model_name)
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


def _resumed_run_folder(resume) -> Path | None:
    """The run folder a path given to --resume names: a checkpoint's parent, or the folder itself (None for
    `latest` / `auto`, which need --output-dir, and for a path that does not exist: resolve_resume says so)."""
    from lstune.train.checkpoint import MANIFEST_NAME

    if not isinstance(resume, str) or resume.lower() in ("latest", "auto"):
        return None
    path = Path(resume).expanduser()
    if not path.exists():
        return None
    return path.parent if _CHECKPOINT_RE.match(path.name) or (path / MANIFEST_NAME).exists() else path


def check_overlaps(output_dir: Path, model_dir: Path | None, data_paths: list[Path]) -> None:
    """Refuse an output folder that would touch the run's own inputs: one inside a --data folder (lstune's
    files there would be read as data by this run and every later one), or a --model / --data path inside one
    of the entries lstune writes or replaces in the output folder (`final/`, a checkpoint: --overwrite removes
    them, the export replaces `final/`, so a LoRA run would lose its base)."""
    out = output_dir.expanduser().resolve()
    for data in data_paths:
        data = data.resolve()
        if data.is_dir() and out.is_relative_to(data):
            raise UserError(
                f"--output-dir {str(output_dir)!r} is inside the --data folder {str(data)!r}: lstune's files there "
                "would be read as training data. Choose an --output-dir outside it."
            )
    inputs = [("--model", model_dir)] if model_dir is not None else []
    for flag, path in inputs + [("--data", p) for p in data_paths]:
        path = path.resolve()
        if path.is_relative_to(out) and path != out and _is_lstune_name(path.relative_to(out).parts[0]):
            entry = out / path.relative_to(out).parts[0]
            where = "is" if path == entry else f"lies inside {str(entry)!r},"
            raise UserError(
                f"{flag} {str(path)!r} {where} which this run writes or replaces in its output "
                f"folder. Copy it elsewhere first, or choose another --output-dir."
            )


def _is_lstune_name(name: str) -> bool:
    from lstune.train.plots import PLOT_FILE
    from lstune.train.tracking import TRACKERS

    return (name in FIXED_NAMES or name == PLOT_FILE or bool(_CHECKPOINT_RE.match(name))
            or name in {folder for _, _, folder in TRACKERS.values()})


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

    def open(self, *, overwrite: bool, writes: tuple[str, ...] = ()) -> "OutputFolder":
        """Lock the folder and check it: `writes` are the names this run writes besides the fixed ones and its
        checkpoints (its plot, its trackers' folders), checked before anything is written."""
        _make_writable(self.path)
        self.lock.acquire()
        try:
            names = (*FIXED_NAMES, *writes)
            _refuse_links(self.path, names)
            recorded = _own_names(self.path, read_record(self.path))
            if overwrite:
                self.previous = recorded | manifest_checkpoints(self.path)
            else:
                self.entries = recorded
            _refuse_foreign(self.path, self.entries | self.previous | manifest_checkpoints(self.path), names)
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
        """Record `name` as lstune's before it is created (so a crash between the two leaves it recorded). A name
        that exists and is not lstune's (not recorded, not a checkpoint with lstune's manifest) is the user's: it is
        refused, never recorded, so that no later --overwrite removes it."""
        if not _is_lstune_name(name):
            raise ValueError(f"{name!r} is not a name lstune writes in an output folder")  # a bug, not the user's
        if name not in self.entries:
            if name not in self.previous and os.path.lexists(self.path / name) and not _has_manifest(self.path / name):
                raise UserError(_foreign_message(self.path, [name]))
            self.entries.add(name)
            _write_record(self.path, self.entries | self.previous)
        return self.path / name

    def to_clear(self) -> set[str]:
        """The names `clear_previous` removes: the previous run's entries (none without --overwrite)."""
        return self.previous - self.entries - {RECORD_NAME, LOCK_NAME, LOG_FILE}

    def clear_previous(self) -> None:
        """--overwrite: remove the previous run's entries (recorded, or checkpoints with our manifest)."""
        for name in sorted(self.to_clear()):
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


def _own_names(output_dir: Path, recorded: set[str]) -> set[str]:
    """The names of a run record that lstune writes: the record is a file in the user's folder, and one crafted
    or copied there may list the user's own files, which --overwrite would then remove. The others are ignored
    (and so stay the user's)."""
    own = {name for name in recorded if _is_lstune_name(name)}
    if recorded - own:
        log.warning("%s lists %s, which lstune never writes; treating them as the user's", output_dir / RECORD_NAME,
                    ", ".join(sorted(recorded - own)))
    return own


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


def _refuse_links(output_dir: Path, names: tuple[str, ...]) -> None:
    links = sorted(
        entry.name for entry in output_dir.iterdir()
        if entry.is_symlink() and (entry.name in names or _CHECKPOINT_RE.match(entry.name))
    )
    if links:
        raise UserError(
            f"--output-dir {str(output_dir)!r} has symbolic links where lstune writes: {', '.join(links)}. lstune never "
            "writes through a link (it could point outside the folder); remove the links or choose another --output-dir."
        )


def _refuse_foreign(output_dir: Path, ours: set[str], names: tuple[str, ...]) -> None:
    """An entry at one of lstune's `names`, or a `checkpoint-N` folder, that lstune did not record (and that
    carries no manifest of lstune's) is the user's: stop, touch nothing."""
    checkpoints = {entry.name for entry in output_dir.iterdir() if _CHECKPOINT_RE.match(entry.name)}
    foreign = sorted(
        name for name in {*names, *checkpoints} - {RECORD_NAME, LOCK_NAME}
        if os.path.lexists(output_dir / name) and name not in ours
    )
    if foreign:
        raise UserError(_foreign_message(output_dir, foreign))


def _foreign_message(output_dir: Path, foreign: list[str]) -> str:
    return (f"--output-dir {str(output_dir)!r} holds {', '.join(foreign)}, which lstune did not write there (its "
            f"{RECORD_NAME} does not list them) and would overwrite. Move them away or choose another --output-dir.")


def _has_manifest(path: Path) -> bool:
    from lstune.train.checkpoint import MANIFEST_NAME

    return _CHECKPOINT_RE.match(path.name) is not None and not path.is_symlink() and (path / MANIFEST_NAME).is_file()


def manifest_checkpoints(output_dir: Path) -> set[str]:
    """The names of the checkpoints in `output_dir` that carry lstune's manifest (complete saves of ours)."""
    return {entry.name for entry in output_dir.iterdir() if _has_manifest(entry)}


def _write_record(output_dir: Path, names: set[str]) -> None:
    """Replace the record atomically (temp file + rename, which replaces a link instead of following it)."""
    body = json.dumps({"format": RECORD_FORMAT, "version": 1, "entries": sorted(names)}, indent=1)
    write_text_new(output_dir / RECORD_NAME, body)


def write_config_snapshot(folder: OutputFolder, view: dict) -> None:
    import yaml

    from lstune import __version__

    header = f"# resolved config written by lstune {__version__}; rerun with: lstune train --config {CONFIG_FILE}\n"
    write_text_new(folder.claim(CONFIG_FILE), header + yaml.safe_dump(view, sort_keys=False))


_WRITE_FAILURES = ("No space left", "os error 28", "Disk quota exceeded", "os error 122", "File too large",
                   "os error 27", "PytorchStreamWriter failed", "inline_container.cc")
_FULL = ("No space left", "os error 28", "Disk quota exceeded", "os error 122")
_NEARLY_FULL_BYTES = 1 << 30  # torch reports every failed write alike: under this much free, call the disk full


@contextmanager
def write_errors(path: Path, *, kept: Path | None):
    """A failed write of `path` (a full disk or quota, a file-size limit) becomes a message naming it and the
    cause, instead of torch's or safetensors' raw error; what was written before (`kept`) is intact, since every
    save is atomic."""
    try:
        yield
    except Exception as exc:
        if not _is_write_failure(exc):
            raise
        try:
            free_bytes = shutil.disk_usage(path.parent).free
            free = f"{free_bytes / 2**20:,.0f} MiB free there now"
        except OSError:
            free_bytes, free = None, "free space unknown"
        full = (isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)) or any(
            marker in str(exc) for marker in _FULL) or (free_bytes is not None and free_bytes < _NEARLY_FULL_BYTES)
        if full:
            cause, fix = f"no space left on its device (or the quota is reached; {free})", "Free space (or lower --keep-last)"
        else:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            cause = (f"the write failed ({first}) with {free}: a file-size limit (`ulimit -f`), the filesystem's "
                     "largest file, or its permissions")
            fix = "Fix that"
        then = f"continue from {kept} with --resume" if kept is not None else "start the run again"
        before = f"{kept} is intact" if kept is not None else "no earlier checkpoint of this run exists"
        raise UserError(
            f"could not write {path}: {cause}. It was not saved and nothing half-written was left; {before}. "
            f"{fix}, then {then}."
        ) from exc


def _is_write_failure(exc: BaseException) -> bool:
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        return True
    return any(marker in str(exc) for marker in _WRITE_FAILURES)
