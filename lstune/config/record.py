"""The names lstune keeps in an output folder besides the run's products: its run record, its log, its lock.

They live here, below the train layer that writes them, because `RunSection.output_dir_problems` asks
whether a folder holds a run: a folder holding only what a run that stopped before training leaves (its
record, its log, a stale lock) does not, and may be used again without --overwrite.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

LOG_FILE = "lstune.log"
LOCK_NAME = ".lstune.lock"
RECORD_NAME = "lstune-run.json"
RECORD_FORMAT = "lstune-output-record"

log = logging.getLogger(__name__)


def read_record(output_dir: Path) -> set[str]:
    """The entry names the folder's run record lists as lstune's; empty when there is no readable record."""
    path = output_dir / RECORD_NAME
    if not path.is_file() or path.is_symlink():
        return set()
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        log.warning("%s is unreadable; treating nothing in %s as lstune's", path, output_dir)
        return set()
    names = data.get("entries") if isinstance(data, dict) and data.get("format") == RECORD_FORMAT else None
    if not isinstance(names, list):
        return set()
    return {n for n in names if isinstance(n, str) and "/" not in n and n not in ("", ".", "..")}


def holds_a_run(output_dir: Path) -> bool:
    """Anything in the folder beyond what a run that stopped before training leaves (its record, its log,
    a stale lock): such a folder may be used again without --overwrite."""
    names = {entry.name for entry in output_dir.iterdir()}
    if not names:
        return False
    return not (names <= {RECORD_NAME, LOG_FILE, LOCK_NAME} and names <= read_record(output_dir) | {LOCK_NAME})
