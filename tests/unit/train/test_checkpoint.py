"""lstune.train.checkpoint and lstune.train.rng: atomic saves, pruning, validation, resume, RNG state.

No model is needed: `write_state` writes a few small files standing in for the engine's.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from lstune.errors import CheckpointError
from lstune.train.checkpoint import (
    MANIFEST_NAME,
    find_latest_checkpoint,
    load_checkpoint,
    resolve_resume,
    save_checkpoint,
    validate_checkpoint,
)
from lstune.train.rng import capture_rng_state, restore_rng_state

ENGINE_FILES = {"model.safetensors": b"weights" * 300, "optimizer/state.bin": b"moments" * 200}


def writer(files: dict[str, bytes] = ENGINE_FILES):
    """A write_state callback that writes `files` (relative path -> bytes), like an engine would."""

    def write_state(folder: Path) -> None:
        for name, data in files.items():
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            (folder / name).write_bytes(data)

    return write_state


def save(output_dir: Path, step: int, files: dict[str, bytes] = ENGINE_FILES, **kwargs) -> Path:
    train_state = {"samples": step * 2}
    return save_checkpoint(output_dir, step, write_state=writer(files), train_state=train_state, **kwargs)


def entries(folder: Path) -> set[str]:
    return {entry.name for entry in folder.iterdir()}


class Recorder:
    """A read_state callback that records the folders it was called with."""

    def __init__(self):
        self.calls: list[Path] = []

    def __call__(self, folder: Path) -> None:
        self.calls.append(folder)


# ----------------------------------------------------------------------------------------------------
# Saving


def test_save_writes_every_file_and_a_manifest_that_matches_them(tmp_path):
    path = save(tmp_path, 7)

    assert path == tmp_path / "checkpoint-7"
    assert entries(tmp_path) == {"checkpoint-7"}  # no temporary folder left behind
    manifest = json.loads((path / MANIFEST_NAME).read_text())
    assert manifest["format"] == "lstune-checkpoint" and manifest["version"] == 1 and manifest["step"] == 7
    listed = {entry["path"]: entry for entry in manifest["files"]}
    assert set(listed) == {"model.safetensors", "optimizer/state.bin", "trainer_state.json", "rng_state.pt"}
    for name, entry in listed.items():
        data = (path / name).read_bytes()
        assert entry["size"] == len(data)
        assert entry["sha256"] == hashlib.sha256(data).hexdigest()
    assert json.loads((path / "trainer_state.json").read_text()) == {"samples": 14, "step": 7}
    assert validate_checkpoint(path) == manifest


def test_an_exception_inside_write_state_leaves_no_checkpoint_and_old_ones_intact(tmp_path):
    save(tmp_path, 1)

    def failing(folder: Path) -> None:
        (folder / "model.safetensors").write_bytes(b"half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(tmp_path, 2, write_state=failing, train_state={})
    assert entries(tmp_path) == {"checkpoint-1"}
    validate_checkpoint(tmp_path / "checkpoint-1")


def _save_and_die(output_dir: Path) -> None:
    def dying(folder: Path) -> None:
        (folder / "model.safetensors").write_bytes(b"half written")
        os._exit(9)  # a SIGKILL / power loss: no exception handler, no cleanup runs

    save_checkpoint(output_dir, 2, write_state=dying, train_state={})


def test_a_crash_inside_write_state_leaves_no_checkpoint_and_the_next_save_cleans_up(tmp_path):
    save(tmp_path, 1)
    child = multiprocessing.get_context("fork").Process(target=_save_and_die, args=(tmp_path,))
    child.start()
    child.join(timeout=60)
    assert child.exitcode == 9

    stale = [name for name in entries(tmp_path) if name.startswith(".tmp-checkpoint-2-")]
    assert len(stale) == 1 and "checkpoint-2" not in entries(tmp_path)
    assert find_latest_checkpoint(tmp_path) == tmp_path / "checkpoint-1"
    validate_checkpoint(tmp_path / "checkpoint-1")

    save(tmp_path, 2)
    assert entries(tmp_path) == {"checkpoint-1", "checkpoint-2"}


def test_train_state_that_is_not_json_fails_before_anything_is_written(tmp_path):
    with pytest.raises(TypeError):
        save_checkpoint(tmp_path, 1, write_state=writer(), train_state={"bad": object()})
    with pytest.raises(ValueError, match="train_state\\['step'\\] is 3"):
        save_checkpoint(tmp_path, 1, write_state=writer(), train_state={"step": 3})
    assert not tmp_path.exists() or entries(tmp_path) == set()


def test_an_engine_file_named_like_lstunes_own_is_refused_not_overwritten(tmp_path):
    with pytest.raises(FileExistsError):
        save(tmp_path, 1, files={"trainer_state.json": b"{}"})
    assert entries(tmp_path) == set()


# ----------------------------------------------------------------------------------------------------
# Replacing and pruning


def test_saving_an_existing_step_again_replaces_it(tmp_path):
    save(tmp_path, 3, files={"model.safetensors": b"first"})
    save(tmp_path, 3, files={"model.safetensors": b"second"})

    assert entries(tmp_path) == {"checkpoint-3"}
    assert (tmp_path / "checkpoint-3" / "model.safetensors").read_bytes() == b"second"
    validate_checkpoint(tmp_path / "checkpoint-3")


def test_a_crash_between_the_two_renames_of_a_replacement_is_undone_by_the_next_save(tmp_path):
    save(tmp_path, 3, files={"model.safetensors": b"old copy"})
    # What a crash right after renaming the old copy aside leaves: the old one aside, the new one in tmp.
    new_copy = save(tmp_path, 2, files={"model.safetensors": b"new copy"})
    new_copy.rename(tmp_path / ".tmp-checkpoint-3-12345678")
    os.rename(tmp_path / "checkpoint-3", tmp_path / ".old-checkpoint-3-0badcafe")

    save(tmp_path, 4)

    assert entries(tmp_path) == {"checkpoint-3", "checkpoint-4"}
    assert (tmp_path / "checkpoint-3" / "model.safetensors").read_bytes() == b"old copy"
    validate_checkpoint(tmp_path / "checkpoint-3")


def test_a_folder_named_like_a_checkpoint_that_is_not_ours_is_never_replaced(tmp_path):
    foreign = tmp_path / "checkpoint-3"
    foreign.mkdir(parents=True)
    (foreign / "pytorch_model.bin").write_bytes(b"someone else's")

    with pytest.raises(CheckpointError, match="is not an lstune checkpoint.*refusing to replace it"):
        save(tmp_path, 3)
    assert entries(tmp_path) == {"checkpoint-3"}
    assert (foreign / "pytorch_model.bin").read_bytes() == b"someone else's"


def test_keep_last_keeps_the_newest_and_touches_nothing_else(tmp_path):
    foreign = tmp_path / "checkpoint-100"  # e.g. an HF Trainer checkpoint: no manifest of ours
    foreign.mkdir(parents=True)
    (foreign / "model.bin").write_bytes(b"x")
    (tmp_path / "notes").mkdir()
    (tmp_path / "checkpoint-x").mkdir()
    (tmp_path / "checkpoint-9").write_text("a file, not a folder")

    for step in range(1, 6):
        save(tmp_path, step, keep_last=2)

    untouched = {"checkpoint-100", "notes", "checkpoint-x", "checkpoint-9"}
    assert entries(tmp_path) == {"checkpoint-4", "checkpoint-5"} | untouched
    assert (foreign / "model.bin").read_bytes() == b"x"


def test_keep_last_counts_only_complete_checkpoints(tmp_path):
    save(tmp_path, 1)
    save(tmp_path, 2)
    with open(tmp_path / "checkpoint-2" / "model.safetensors", "r+b") as f:
        f.truncate(10)

    save(tmp_path, 3, keep_last=2)

    assert entries(tmp_path) == {"checkpoint-1", "checkpoint-3"}


def test_keep_last_never_deletes_the_checkpoint_just_written(tmp_path):
    save(tmp_path, 5)
    save(tmp_path, 3, keep_last=1)  # a run resumed from an earlier step

    assert entries(tmp_path) == {"checkpoint-3"}


def test_keep_last_must_be_positive(tmp_path):
    with pytest.raises(ValueError, match="keep_last"):
        save(tmp_path, 1, keep_last=0)


# ----------------------------------------------------------------------------------------------------
# Finding, validating and loading


def _partial(output_dir: Path, step: int) -> Path:
    path = save(output_dir, step)
    (path / MANIFEST_NAME).unlink()
    return path


def test_latest_skips_partial_and_incomplete_checkpoints(tmp_path):
    assert find_latest_checkpoint(tmp_path / "missing") is None
    assert find_latest_checkpoint(tmp_path) is None
    save(tmp_path, 10)
    _partial(tmp_path, 20)
    (save(tmp_path, 30) / "model.safetensors").unlink()
    with open(save(tmp_path, 40) / "optimizer" / "state.bin", "ab") as f:
        f.write(b"grown")

    assert find_latest_checkpoint(tmp_path) == tmp_path / "checkpoint-10"


def _flip_byte(file: Path) -> None:
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0x01
    file.write_bytes(bytes(data))


CORRUPTIONS = {
    "missing manifest": (
        lambda path: (path / MANIFEST_NAME).unlink(),
        "has no lstune-checkpoint.json: its save was interrupted (a partial checkpoint)",
    ),
    "missing file": (
        lambda path: (path / "optimizer" / "state.bin").unlink(),
        "optimizer/state.bin is missing (its manifest lists it)",
    ),
    "truncated file": (
        lambda path: os.truncate(path / "model.safetensors", 100),
        "model.safetensors is 100 bytes but its manifest records 2100 (truncated or overwritten)",
    ),
    "flipped byte": (
        lambda path: _flip_byte(path / "model.safetensors"),
        "model.safetensors does not match the sha256 in its manifest (the file is corrupt)",
    ),
    "garbage manifest": (
        lambda path: (path / MANIFEST_NAME).write_text('{"format": "lstune-checkpoint", "vers'),
        "lstune-checkpoint.json is unreadable (corrupt)",
    ),
    "newer format": (
        lambda path: (path / MANIFEST_NAME).write_text('{"format": "lstune-checkpoint", "version": 99}'),
        "checkpoint format version 99, and this lstune reads up to version 1: upgrade lstune",
    ),
}


@pytest.mark.parametrize("corruption", list(CORRUPTIONS))
def test_a_partial_or_corrupt_checkpoint_is_refused_before_read_state(tmp_path, corruption):
    damage, expected = CORRUPTIONS[corruption]
    save(tmp_path, 1)
    save(tmp_path, 2)
    path = save(tmp_path, 3)
    damage(path)
    read_state = Recorder()

    with pytest.raises(CheckpointError) as error:
        load_checkpoint(path, read_state=read_state)

    assert read_state.calls == []
    message = str(error.value)
    assert message.startswith(f"Checkpoint {path} cannot be loaded:")
    assert expected in message
    if corruption == "missing manifest":  # then checkpoint-3 is not lstune's, and checkpoint-2 is the newest
        assert f"Resume from another complete checkpoint in {tmp_path} instead: checkpoint-2." in message
    else:  # checkpoint-3 is still lstune's: resuming from checkpoint-2 beside it is refused, so say both ways
        assert f"The newest other checkpoint in {tmp_path} that verifies is checkpoint-2" in message
        assert f"--resume {tmp_path / 'checkpoint-2'} --output-dir NEW_FOLDER" in message
        assert f"or move checkpoint-3 out of {tmp_path}" in message
    assert "checkpoint-1" not in message  # the newest that verifies is enough
    assert error.value.exit_code == 2


def test_the_fix_says_to_start_again_when_no_other_checkpoint_is_complete(tmp_path):
    path = save(tmp_path, 1)
    _flip_byte(path / "model.safetensors")

    with pytest.raises(CheckpointError, match="No other complete checkpoint is in .*start the run again"):
        validate_checkpoint(path)
    assert validate_checkpoint(path, verify_hashes=False)["step"] == 1  # sizes alone cannot see a flip


def test_the_fix_names_only_a_checkpoint_whose_hashes_verify(tmp_path):
    save(tmp_path, 2)
    partial = _partial(tmp_path, 4)
    _flip_byte(save(tmp_path, 6) / "optimizer" / "state.bin")  # sizes match: only its sha256 can tell

    with pytest.raises(CheckpointError) as error:
        resolve_resume(tmp_path, str(partial))
    message = str(error.value)
    assert f"The newest other checkpoint in {tmp_path} that verifies is checkpoint-2" in message
    assert "Resume from another complete checkpoint" not in message and "instead: checkpoint-6" not in message
    assert f"or move checkpoint-6 out of {tmp_path}" in message

    _flip_byte(tmp_path / "checkpoint-2" / "model.safetensors")
    with pytest.raises(CheckpointError) as error:
        resolve_resume(tmp_path, str(partial))
    assert (
        f"No other checkpoint in {tmp_path} verifies either (checkpoint-6, checkpoint-2); start the run again "
        "without resuming."
    ) in str(error.value)


def test_the_fix_verifies_newest_first_and_stops_at_the_first_good_one(tmp_path, monkeypatch):
    from lstune.train import checkpoint

    for step in (1, 2, 3, 4):
        save(tmp_path, step)
    _flip_byte(tmp_path / "checkpoint-4" / "model.safetensors")
    _flip_byte(tmp_path / "checkpoint-3" / "model.safetensors")
    hashed = set()
    real_hash_file = checkpoint._hash_file

    def recording_hash_file(path: Path, fsync: bool) -> dict:
        hashed.add(path.relative_to(tmp_path).parts[0])
        return real_hash_file(path, fsync)

    monkeypatch.setattr(checkpoint, "_hash_file", recording_hash_file)

    with pytest.raises(CheckpointError, match="that verifies is checkpoint-2"):
        validate_checkpoint(tmp_path / "checkpoint-4")

    assert hashed == {"checkpoint-4", "checkpoint-3", "checkpoint-2"}  # checkpoint-1 is never read


def test_load_calls_read_state_restores_the_rng_and_returns_train_state(tmp_path):
    torch.manual_seed(0)
    path = save(tmp_path, 4)
    after_save = torch.rand(5)
    torch.manual_seed(1234)

    calls = []

    def read_state(folder: Path) -> None:
        calls.append(folder)
        torch.rand(100)  # loading may draw random numbers; the restored state must still win

    train_state = load_checkpoint(path, read_state=read_state)

    assert calls == [path]
    assert train_state == {"samples": 8, "step": 4}
    assert torch.equal(torch.rand(5), after_save)


def test_load_can_leave_the_rng_alone(tmp_path):
    path = save(tmp_path, 4)
    torch.manual_seed(1234)
    expected = torch.rand(5)
    torch.manual_seed(1234)

    read_state = Recorder()
    load_checkpoint(path, read_state=read_state, restore_rng=False)

    assert read_state.calls == [path]
    assert torch.equal(torch.rand(5), expected)


# ----------------------------------------------------------------------------------------------------
# Resolving --resume


def test_resume_off_starts_fresh(tmp_path):
    save(tmp_path, 1)
    assert resolve_resume(tmp_path, None) is None
    assert resolve_resume(tmp_path, False) is None


@pytest.mark.parametrize("resume", [True, "latest", "LATEST", "auto"])
def test_resume_latest_takes_the_newest_complete_checkpoint(tmp_path, resume):
    save(tmp_path, 1)
    save(tmp_path, 2)
    _partial(tmp_path, 3)
    assert resolve_resume(tmp_path, resume) == tmp_path / "checkpoint-2"


def test_resume_auto_starts_fresh_when_there_is_nothing(tmp_path):
    assert resolve_resume(tmp_path / "new-run", "auto") is None
    assert resolve_resume(tmp_path, "auto") is None


def test_resume_latest_without_a_checkpoint_says_what_was_found(tmp_path):
    with pytest.raises(CheckpointError, match=f"Nothing to resume: {tmp_path / 'nope'} does not exist"):
        resolve_resume(tmp_path / "nope", True)
    with pytest.raises(CheckpointError, match="it holds no checkpoint-STEP folder"):
        resolve_resume(tmp_path, True)

    _partial(tmp_path, 20)
    (tmp_path / ".tmp-checkpoint-30-0123abcd").mkdir()
    with pytest.raises(CheckpointError) as error:
        resolve_resume(tmp_path, "latest")
    message = str(error.value)
    assert f"Nothing to resume in {tmp_path}: no complete checkpoint; found only: checkpoint-20 (it has no " in (
        message
    )
    assert ".tmp-checkpoint-30-0123abcd (a save that was interrupted)" in message


def test_resume_from_a_path(tmp_path):
    older = save(tmp_path, 1)
    save(tmp_path, 2)

    assert resolve_resume(tmp_path / "elsewhere", str(older)) == older
    assert resolve_resume(tmp_path / "elsewhere", older) == older
    assert resolve_resume(tmp_path / "elsewhere", str(tmp_path)) == tmp_path / "checkpoint-2"


def _snapshot(folder: Path) -> dict[str, tuple[int, bytes]]:
    """Every entry under `folder` with its mtime and contents, to show that nothing was written."""
    return {
        path.relative_to(folder).as_posix(): (path.stat().st_mtime_ns, path.read_bytes() if path.is_file() else b"")
        for path in sorted(folder.rglob("*"))
    }


def test_resume_from_an_earlier_checkpoint_in_its_own_folder_is_refused_before_anything_is_written(tmp_path):
    for step in (4, 6, 8):
        save(tmp_path, step)
    before = _snapshot(tmp_path)

    with pytest.raises(CheckpointError) as error:
        resolve_resume(tmp_path, str(tmp_path / "checkpoint-4"))

    message = str(error.value)
    assert message.startswith(f"Cannot resume from {tmp_path / 'checkpoint-4'} in {tmp_path}: it is not the newest")
    assert "(checkpoint-6, checkpoint-8 came later)" in message
    assert f"--resume {tmp_path / 'checkpoint-4'} --output-dir NEW_FOLDER" in message
    assert f"or move checkpoint-6, checkpoint-8 out of {tmp_path}" in message
    assert error.value.exit_code == 2
    assert _snapshot(tmp_path) == before


def test_resume_from_the_newest_or_into_another_folder_is_allowed(tmp_path):
    for step in (4, 6, 8):
        save(tmp_path, step)

    assert resolve_resume(tmp_path, str(tmp_path / "checkpoint-8")) == tmp_path / "checkpoint-8"
    assert resolve_resume(tmp_path, True) == tmp_path / "checkpoint-8"
    assert resolve_resume(tmp_path / "branch", str(tmp_path / "checkpoint-4")) == tmp_path / "checkpoint-4"


def test_only_lstunes_later_checkpoints_refuse_a_resume_damaged_ones_included(tmp_path):
    save(tmp_path, 4)
    (tmp_path / "checkpoint-100").mkdir()  # e.g. an HF Trainer checkpoint: lstune never touches it
    (tmp_path / "checkpoint-100" / "model.bin").write_bytes(b"x")
    assert resolve_resume(tmp_path, str(tmp_path / "checkpoint-4")) == tmp_path / "checkpoint-4"

    (save(tmp_path, 6) / "model.safetensors").unlink()  # still lstune's, and not to be lost
    with pytest.raises(CheckpointError, match=r"\(checkpoint-6 came later\)"):
        resolve_resume(tmp_path, str(tmp_path / "checkpoint-4"))


def test_resume_from_a_path_without_a_usable_checkpoint_is_refused(tmp_path):
    with pytest.raises(CheckpointError, match="Cannot resume from .*missing: it does not exist"):
        resolve_resume(tmp_path, str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="Nothing to resume in .*empty"):
        resolve_resume(tmp_path, str(tmp_path / "empty"))
    partial = _partial(tmp_path / "run", 5)
    with pytest.raises(CheckpointError, match="partial checkpoint"):
        resolve_resume(tmp_path, str(partial))


# ----------------------------------------------------------------------------------------------------
# RNG state


def _draws() -> tuple:
    return random.random(), float(np.random.rand()), torch.rand(3).tolist(), torch.randint(10**6, (1,)).item()


def test_rng_round_trip_restores_every_generator(tmp_path):
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    np.random.standard_normal()  # leaves a cached gaussian in NumPy's state, which must survive too
    state = capture_rng_state()
    expected = _draws()
    assert _draws() != expected  # the generators move on, so equality below is not by chance

    torch.save(state, tmp_path / "rng.pt")
    restore_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True))

    assert _draws() == expected


# ----------------------------------------------------------------------------------------------------
# Several processes


def _distributed_worker(rank: int, world_size: int, root: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{root}/rendezvous", rank=rank, world_size=world_size)
    out, report = Path(root) / "out", {}
    try:
        torch.manual_seed(100 + rank)
        files = {f"shard-rank{rank}.bin": bytes([rank]) * 1000}
        if rank == 0:
            files["model.bin"] = b"m" * 3000
        path = save_checkpoint(out, 1, write_state=writer(files), train_state={"samples": 8})
        report["draws"] = torch.rand(4).tolist()
        torch.manual_seed(999)
        report["train_state"] = load_checkpoint(path, read_state=Recorder())
        report["draws_after_load"] = torch.rand(4).tolist()

        def failing(folder: Path) -> None:
            if rank == 1:
                raise OSError("disk full on rank 1")

        try:
            save_checkpoint(out, 2, write_state=failing, train_state={})
        except Exception as exc:  # noqa: BLE001 - the report carries it to the test
            report["failure"] = f"{type(exc).__name__}: {exc}"

        dist.barrier()
        if rank == 0:
            _flip_byte(path / "shard-rank1.bin")
        dist.barrier()
        try:
            load_checkpoint(path, read_state=Recorder())
        except CheckpointError as exc:
            report["corrupt"] = str(exc)
    finally:
        (Path(root) / f"rank{rank}.json").write_text(json.dumps(report))
        dist.destroy_process_group()


def test_ranks_save_together_split_the_work_and_agree_on_failures(tmp_path):
    context = multiprocessing.get_context("spawn")
    ranks = [context.Process(target=_distributed_worker, args=(rank, 2, str(tmp_path))) for rank in range(2)]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join(timeout=120)
        if process.is_alive():
            process.kill()
    assert [process.exitcode for process in ranks] == [0, 0]
    reports = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]

    out = tmp_path / "out"
    assert entries(out) == {"checkpoint-1"}  # the failed save of step 2 left nothing behind
    manifest = json.loads((out / "checkpoint-1" / MANIFEST_NAME).read_text())
    assert manifest["world_size"] == 2
    assert {entry["path"] for entry in manifest["files"]} == {
        "model.bin", "shard-rank0.bin", "shard-rank1.bin", "trainer_state.json", "rng_state-rank0.pt",
        "rng_state-rank1.pt",
    }
    for report in reports:
        assert report["train_state"] == {"samples": 8, "step": 1}
        assert report["draws_after_load"] == report["draws"]  # each rank got its own RNG state back
        assert "shard-rank1.bin does not match the sha256" in report["corrupt"]
    assert reports[0]["draws"] != reports[1]["draws"]
    assert reports[0]["failure"] == (
        "RuntimeError: checkpoint-2 was not saved: rank 1 failed: OSError: disk full on rank 1"
    )
    assert reports[1]["failure"] == "OSError: disk full on rank 1"
