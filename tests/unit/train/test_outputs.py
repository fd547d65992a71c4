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


@pytest.mark.parametrize("name, writes", [("checkpoint-4", ()), ("metrics.png", ("metrics.png",)),
                                          ("tensorboard", ("tensorboard",))])
def test_a_users_entry_where_the_run_will_write_is_refused_at_open(tmp_path, name, writes):
    """The run's plot, its trackers' folders and checkpoint-N folders without lstune's manifest count as the user's
    when the record does not list them: refused before anything is written, with or without --overwrite."""
    (tmp_path / name).mkdir()
    (tmp_path / name / "mine.bin").write_text("the user's")
    for overwrite in (False, True):
        with pytest.raises(UserError, match=f"holds {name}, which lstune did not write"):
            OutputFolder(tmp_path).open(overwrite=overwrite, writes=writes)
    assert sorted(p.name for p in tmp_path.iterdir()) == [name]


def test_a_claim_never_records_a_name_that_is_not_lstunes(tmp_path):
    """The last check, as each entry is claimed: a user's folder that appeared at a checkpoint's name is refused and
    stays out of the record, so that a later --overwrite cannot remove it."""
    folder = OutputFolder(tmp_path).open(overwrite=False)
    (tmp_path / "checkpoint-4").mkdir()
    with pytest.raises(UserError, match="checkpoint-4, which lstune did not write"):
        folder.claim("checkpoint-4")
    folder.close()
    assert "checkpoint-4" not in json.loads((tmp_path / RECORD_NAME).read_text())["entries"]
    folder = OutputFolder(tmp_path)
    with pytest.raises(UserError, match="checkpoint-4"):
        folder.open(overwrite=True)
    assert (tmp_path / "checkpoint-4").is_dir()


def test_a_link_at_a_trackers_folder_is_refused(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    out = tmp_path / "out"
    out.mkdir()
    (out / "tensorboard").symlink_to(outside)
    with pytest.raises(UserError, match="symbolic links where lstune writes: tensorboard"):
        OutputFolder(out).open(overwrite=True, writes=("tensorboard",))


def test_inputs_inside_what_the_run_writes_or_an_output_inside_the_data_are_refused(tmp_path):
    from lstune.train.outputs import check_overlaps

    data = tmp_path / "ds"
    data.mkdir()
    with pytest.raises(UserError, match="inside the --data folder"):
        check_overlaps(data / "out", None, [data])
    with pytest.raises(UserError, match="inside the --data folder"):
        check_overlaps(data, None, [data])
    run = tmp_path / "run"
    (run / "final").mkdir(parents=True)
    with pytest.raises(UserError, match="--model .*final' is which this run"):
        check_overlaps(run, run / "final", [data])
    with pytest.raises(UserError, match="--data .* lies inside .*checkpoint-2'"):
        check_overlaps(run, None, [run / "checkpoint-2" / "x.jsonl"])
    check_overlaps(run, tmp_path / "model", [data, run / "my-data.jsonl"])  # beside, or a name lstune never writes


@pytest.mark.parametrize("exc, cause, gone", [
    (OSError(27, "File too large"), "a file-size limit", "no space left"),
    (OSError(28, "No space left on device"), "no space left", "file-size limit"),
])
def test_a_failed_write_names_its_cause_and_suggests_resume_only_with_a_checkpoint(tmp_path, exc, cause, gone):
    from lstune.train.outputs import write_errors

    for kept, then in ((None, "start the run again"), (tmp_path / "checkpoint-2", "with --resume")):
        with pytest.raises(UserError) as raised:
            with write_errors(tmp_path / "checkpoint-4", kept=kept):
                raise exc
        message = str(raised.value)
        assert cause in message and gone not in message and then in message, message
        assert ("--resume" in message) == (kept is not None), message
