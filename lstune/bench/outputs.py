"""The bench's output folder: checked before any trial runs; bench writes there only names it recorded as its own.

What bench writes in --output-dir: bench.json, bench.md, the plots (PLOT_FILES), `trials/` with each trial's
trial-N.json and trial-N.log (and trial-N.job.json under --gpus N), and RECORD_NAME, which lists every one of
them and is updated before each is created (a crash between the two leaves a name recorded, never one unrecorded).

- A file or folder at one of those names that the record does not list is the user's: bench stops before any
  trial, with or without --overwrite, and touches nothing (a bench from before the record existed counts too).
- One the record lists is an earlier bench's: replaced only with --overwrite; those the new bench does not write
  again (the trials of a longer bench, a plot it has nothing for) are removed once its results are written, so
  the folder holds one bench. Nothing else in the folder is touched; `trials/` is removed only when empty.
- Symbolic links at bench's names are refused. Every file is written to a temporary name created exclusively
  (O_EXCL: no one else's file) and renamed into place, or opened with O_NOFOLLOW: nothing is written through a link.

A record of its own, not train's lstune-run.json: bench's names include paths inside `trials/`, and each command's
--overwrite clears only what that command wrote.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from lstune.errors import ConfigError, UserError
from lstune.train.atomic import write_text_new

RECORD_NAME = "lstune-bench-files.json"
RECORD_FORMAT = "lstune-bench-files"
RESULT_FILES = ("bench.json", "bench.md")
PLOT_FILES = ("longest.png", "peak-vs-length.png", "tokens-per-s.png")
TRIALS_DIR = "trials"
# The names lstune.bench.runner gives trial N's record, log and (launched trials) job inside TRIALS_DIR.
TRIAL_FILE = re.compile(r"^trial-\d+\.(json|log|job\.json)$")
_SHOWN = 6  # names listed in a message before "and N more"


class BenchFolder:
    """The checked output folder: `claim` records names as the bench's before they are created; `clear_previous`
    (--overwrite) removes what an earlier bench wrote there and this one did not write again."""

    def __init__(self, path: Path, previous: set[str]):
        self.path = path
        self.previous = previous  # an earlier bench's entries, present in the folder (only with --overwrite)
        self.entries: set[str] = set()

    def claim(self, *paths: Path) -> None:
        """Record `paths` (inside the folder) as the bench's before they are created; refuses a name that has become
        a link or someone else's since the check (the user may have written there while trials ran)."""
        names = [Path(p).relative_to(self.path).as_posix() for p in paths]
        new = [n for n in names if n not in self.entries]
        if not new:
            return
        taken = [n for n in new if os.path.lexists(self.path / n) and (n not in self.previous
                                                                       or os.path.islink(self.path / n))]
        if taken:
            raise UserError(f"{_listed(taken)} appeared in --output-dir {str(self.path)!r} while the bench ran; "
                            "lstune bench writes only its own files. Move them away and run the bench again.")
        self.entries.update(new)
        self._write_record()

    def clear_previous(self) -> None:
        """Remove the earlier bench's entries this bench did not write again: files, then `trials/` if left empty."""
        for name in sorted(self.previous - self.entries, reverse=True):  # trials/… before trials
            path = self.path / name
            if path.is_symlink():
                continue
            try:
                path.rmdir() if path.is_dir() else path.unlink(missing_ok=True)
            except OSError:  # a folder still holding the user's files stays, and stays recorded
                continue
        self.previous = {n for n in self.previous if os.path.lexists(self.path / n)}
        self._write_record()

    def _write_record(self) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        body = {"format": RECORD_FORMAT, "version": 1, "entries": sorted(self.entries | self.previous)}
        write_text_new(self.path / RECORD_NAME, json.dumps(body, indent=1) + "\n")


def check_folder(path: Path, *, overwrite: bool) -> BenchFolder:
    """`path` as the bench's output folder, checked before any trial runs (UserError naming what is in the way and
    the fix): no link at bench's names, none of them the user's, an earlier bench's replaced only with --overwrite."""
    if os.path.lexists(path) and not path.is_dir():
        from lstune.untrusted import path_kind

        raise ConfigError([f"--output-dir {str(path)!r} is {path_kind(path)}; give a folder."])
    if not path.exists():
        return BenchFolder(path, set())
    present = _present(path)
    _refuse_links(path, present)
    recorded = _read_record(path, RECORD_NAME in present)
    foreign = sorted(present - recorded - {RECORD_NAME})
    if foreign:
        raise UserError(
            f"--output-dir {str(path)!r} holds {_listed(foreign)}, which lstune bench did not write (they are not "
            f"in its record, {RECORD_NAME}) and would overwrite; --overwrite replaces only an earlier bench's "
            "files. Move them away or give another --output-dir.")
    earlier = sorted(present & recorded)
    if earlier and not overwrite:
        raise ConfigError([f"--output-dir {str(path)!r} already holds {_listed(earlier)} of an earlier bench; add "
                           "--overwrite to replace them, or give another --output-dir."])
    return BenchFolder(path, set(earlier))


def _present(path: Path) -> set[str]:
    """Bench's names that exist in `path` (links included): its files, `trials/` and the trial files in it."""
    names = {n for n in (*RESULT_FILES, *PLOT_FILES, TRIALS_DIR, RECORD_NAME) if os.path.lexists(path / n)}
    trials = path / TRIALS_DIR
    if TRIALS_DIR in names and trials.is_dir() and not trials.is_symlink():
        names |= {f"{TRIALS_DIR}/{e.name}" for e in trials.iterdir() if TRIAL_FILE.match(e.name)}
    return names


def _refuse_links(path: Path, present: set[str]) -> None:
    links = sorted(n for n in present if os.path.islink(path / n))
    if links:
        raise UserError(
            f"--output-dir {str(path)!r} has symbolic links where lstune bench writes: {_listed(links)}. bench never "
            "writes through a link (it could point outside the folder); remove the links or give another --output-dir.")


def _read_record(path: Path, exists: bool) -> set[str]:
    """The names the folder's record lists, only those bench can write (a crafted record names nothing else);
    a file at the record's name that is no bench record is the user's."""
    if not exists:
        return set()
    try:
        data = json.loads((path / RECORD_NAME).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        data = None
    if not (isinstance(data, dict) and data.get("format") == RECORD_FORMAT and isinstance(data.get("entries"), list)):
        raise UserError(f"--output-dir {str(path)!r} holds {RECORD_NAME}, which is not a record lstune bench wrote; "
                        "move it away or give another --output-dir.")
    return {n for n in data["entries"] if isinstance(n, str) and _is_bench_name(n)}


def _is_bench_name(name: str) -> bool:
    if name in (*RESULT_FILES, *PLOT_FILES, TRIALS_DIR):
        return True
    folder, _, file = name.partition("/")
    return folder == TRIALS_DIR and bool(TRIAL_FILE.match(file))


def _listed(names: list[str]) -> str:
    shown = ", ".join(names[:_SHOWN])
    return shown if len(names) <= _SHOWN else f"{shown} and {len(names) - _SHOWN} more"


def open_new_log(path: Path) -> int:
    """A trial's log, truncated (the folder check made it the bench's or new), never opened through a link."""
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0), 0o644)
