"""The output folder's lock and its record of lstune's own files."""

from __future__ import annotations

import json
import os

import pytest

from lstune.errors import UserError
from lstune.train.lock import LOCK_NAME, OutputLock
from lstune.train.outputs import RECORD_NAME, OutputFolder


def test_a_held_lock_refuses_a_second_holder_naming_the_first(tmp_path):
    first = OutputLock(tmp_path).acquire()
    try:
        with pytest.raises(UserError, match=f"pid {os.getpid()}"):
            OutputLock(tmp_path).acquire()
    finally:
        first.release()
    assert not (tmp_path / LOCK_NAME).exists()
    OutputLock(tmp_path).acquire().release()  # free again once released


def test_a_lock_file_nobody_holds_is_stale_and_taken_over(tmp_path):
    (tmp_path / LOCK_NAME).write_text(json.dumps({"pid": 999999, "host": "gone"}))  # left by a kill -9
    lock = OutputLock(tmp_path).acquire()
    try:
        assert lock.stale == {"pid": 999999, "host": "gone"}
        assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
    finally:
        lock.release()


def test_overwrite_removes_only_recorded_entries_and_only_when_asked(tmp_path):
    out = tmp_path / "run"
    folder = OutputFolder(out).open(overwrite=False)
    for name in ("config.yaml", "metrics.jsonl"):
        folder.claim(name).write_text("ours")
    (folder.claim("checkpoint-2")).mkdir()
    folder.close()
    users = ["final_report.txt", "config.yaml.bak", "metrics.jsonl.orig", "checkpoint-notes"]
    for name in users:
        (out / name).write_text("the user's")
    (out / "finals").mkdir()

    folder = OutputFolder(out).open(overwrite=True)
    assert (out / "config.yaml").exists() and (out / "checkpoint-2").exists()  # nothing removed at open
    folder.clear_previous()
    folder.close()
    assert sorted(p.name for p in out.iterdir()) == sorted(users + ["finals", RECORD_NAME, "lstune.log"])


def test_an_unrecorded_file_at_lstunes_name_is_the_users(tmp_path):
    (tmp_path / "config.yaml").write_text("mine")
    with pytest.raises(UserError, match="config.yaml, which lstune did not write"):
        OutputFolder(tmp_path).open(overwrite=True)
    assert (tmp_path / "config.yaml").read_text() == "mine"
    assert not (tmp_path / LOCK_NAME).exists()
