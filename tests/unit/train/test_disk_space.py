"""The disk check before training (lstune.train.disk_space): a disk without room for one checkpoint is a problem,
one without room for what the run has there at once (the checkpoints --keep-last keeps, and the save being written)
is a warning; what --overwrite removes counts as free, a resumed run's checkpoints as kept; the saves a run makes
are counted as its loop makes them."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

import lstune.train.disk_space as disk_space
from lstune.train.disk_space import disk_answer

PARAMS = SimpleNamespace(trainable=1_000_000)  # a checkpoint: at least 12 MB (fp32 weight + two AdamW moments)
NEED = 12_000_000


@pytest.fixture
def free(monkeypatch):
    def set_free(nbytes):
        monkeypatch.setattr(disk_space, "free_bytes", lambda path: nbytes)

    return set_free


def test_no_room_for_one_checkpoint_is_a_problem_naming_the_sizes_and_the_fixes(free, tmp_path):
    free(NEED - 1)
    problem, warning = disk_answer(tmp_path, PARAMS, saves=1, keep_last=2)
    assert warning is None
    for words in (str(tmp_path), "11.4 MiB free", "at least 11.4 MiB", "1,000,000 trainable parameters",
                  "first save would fail", "--output-dir", "--force"):
        assert words in problem, (words, problem)


@pytest.mark.parametrize("room, saves, keep_last, kept, at_once", [
    (1, 5, 2, 0, 3),  # --keep-last 2: two kept and a third being written
    (2, 5, 2, 0, 3),
    (3, 5, 2, 0, None),
    (1, 1, 2, 0, None),  # a run that saves once needs room for one
    (1, 2, 2, 0, 2),
    (1, 5, 2, 2, None),  # a resumed run's two checkpoints are there already: each save adds one, then prunes one
    (1, 5, 2, 1, 2),
    (1, 5, 1, 0, 2),
    (2, 5, 1, 0, None),
    (4, 5, 0, 0, 5),  # --keep-last 0 keeps every one it saves
    (5, 5, 0, 3, None),
])
def test_room_for_fewer_than_the_run_has_at_once_is_a_warning(free, tmp_path, room, saves, keep_last, kept, at_once):
    free(room * NEED + NEED // 2)
    problem, warning = disk_answer(tmp_path, PARAMS, saves=saves, keep_last=keep_last, kept=kept)
    assert problem is None and (warning is not None) == (at_once is not None), warning
    if at_once is not None:
        assert f"it saves {saves} checkpoint(s) of at least 11.4 MiB each" in warning
        assert f"up to {at_once} at once" in warning and "lower --keep-last" in warning
        assert "final model" not in warning  # none asked for here


@pytest.mark.parametrize("saves, keep_last, kept, more_at_end", [
    (5, 2, 0, 2), (1, 2, 0, 1), (5, 0, 0, 5),
    (3, 2, 2, 0),  # a resumed run's two are pruned as its own come: no more than before
    (0, 2, 1, 0),  # resumed at the end: the export only
])
def test_the_final_model_is_written_beside_the_checkpoints_kept(free, tmp_path, saves, keep_last, kept,
                                                                more_at_end):
    """Free space beyond the checkpoints already there: what the run adds by its end, the final model last."""
    final = 3 * NEED
    free(more_at_end * NEED + final)
    assert disk_answer(tmp_path, PARAMS, saves=saves, keep_last=keep_last, kept=kept, final=final) == (None, None)
    free(more_at_end * NEED + final - 1)
    problem, warning = disk_answer(tmp_path, PARAMS, saves=saves, keep_last=keep_last, kept=kept, final=final)
    assert problem is None and "its final model takes at least 34.3 MiB more at the end" in warning


def test_the_final_models_least_bytes():
    from lstune.estimate.memory import final_model_min_bytes

    full = SimpleNamespace(total=1000, adapters=0)
    lora = SimpleNamespace(total=1100, adapters=100)
    assert final_model_min_bytes(full, merge_lora=False) == final_model_min_bytes(full, merge_lora=True) == 2000
    assert final_model_min_bytes(lora, merge_lora=False) == 200  # the adapter
    assert final_model_min_bytes(lora, merge_lora=True) == 200 + 2000  # and the merged model


def test_what_overwrite_removes_counts_as_free(free, tmp_path):
    free(NEED // 2)
    assert disk_answer(tmp_path, PARAMS, saves=3, keep_last=1)[0] is not None
    assert disk_answer(tmp_path, PARAMS, saves=3, keep_last=1, freed=2 * NEED) == (None, None)


def test_a_file_system_that_does_not_say_and_a_model_with_nothing_to_train_are_not_checked(free, tmp_path):
    free(None)
    assert disk_answer(tmp_path, PARAMS, saves=1, keep_last=2) == (None, None)
    free(0)
    assert disk_answer(tmp_path, SimpleNamespace(trainable=0), saves=1, keep_last=2) == (None, None)
    assert disk_answer(tmp_path, PARAMS, saves=0, keep_last=2) == (None, None)  # nothing to save or export


def test_free_bytes_reads_the_file_system_and_says_none_for_a_missing_path(tmp_path):
    assert disk_space.free_bytes(tmp_path) > 0
    assert disk_space.free_bytes(tmp_path / "missing" / "deeper") is None


def test_the_bytes_overwrite_frees_are_the_previous_entries_without_following_links(tmp_path):
    (tmp_path / "checkpoint-2").mkdir()
    (tmp_path / "checkpoint-2" / "optimizer.pt").write_bytes(b"x" * 1000)
    (tmp_path / "checkpoint-2" / "model").mkdir()
    (tmp_path / "checkpoint-2" / "model" / "w.safetensors").write_bytes(b"x" * 500)
    (tmp_path / "metrics.jsonl").write_bytes(b"x" * 20)
    outside = tmp_path.parent / f"{tmp_path.name}-outside"
    outside.mkdir()
    (outside / "big").write_bytes(b"x" * 10_000)
    (tmp_path / "linked").symlink_to(outside)
    assert disk_space._bytes_of(tmp_path, {"checkpoint-2", "metrics.jsonl", "linked", "gone"}) == 1520


@pytest.mark.parametrize("save_every, stop_at, resumed, max_steps, saves", [
    (None, None, None, 10, 1),  # only at the end
    (5, None, None, 10, 2),  # 5, and 10 at the end (not twice)
    (3, None, None, 10, 4),  # 3, 6, 9, 10
    (3, 7, None, 10, 3),  # 3, 6, then 7 where --stop-at-step stops it
    (3, 6, None, 10, 2),  # 3, then 6 at the stop (once)
    (3, None, 6, 10, 2),  # resumed at 6: 9, 10
    (3, None, 10, 10, 0),  # resumed at the end: nothing to save
])
def test_the_saves_a_run_makes(tmp_path, save_every, stop_at, resumed, max_steps, saves):
    from lstune.train.checkpoint import save_checkpoint

    checkpoint = None
    if resumed is not None:
        checkpoint = save_checkpoint(tmp_path, resumed, write_state=lambda folder: None, train_state={})
    run = SimpleNamespace(save_every=save_every, stop_at_step=stop_at)
    assert disk_space.planned_saves(run, checkpoint, max_steps) == saves


def test_the_saves_count_as_the_training_loop_makes_them(tmp_path):
    """The same count as a loop saving at every --save-every step before the last, then at the end."""
    for save_every in (None, 1, 2, 3, 7):
        for stop_at in (None, 1, 4, 9):
            for max_steps in (1, 5, 9, 12):
                end = min(max_steps, stop_at) if stop_at is not None else max_steps
                saved = {s for s in range(1, end + 1) if save_every and s % save_every == 0 and s < max_steps
                         and s != stop_at} | {end}
                run = SimpleNamespace(save_every=save_every, stop_at_step=stop_at)
                assert disk_space.planned_saves(run, None, max_steps) == len(saved), (save_every, stop_at, max_steps)


def test_a_checkpoint_whose_manifest_cannot_be_read_counts_from_step_0(tmp_path):
    from lstune.train.checkpoint import MANIFEST_NAME

    broken = tmp_path / "checkpoint-6"
    broken.mkdir()
    (broken / MANIFEST_NAME).write_text("{not json")
    run = SimpleNamespace(save_every=3, stop_at_step=None)
    assert disk_space.planned_saves(run, broken, 10) == 4  # 3, 6, 9, 10: its load says what is wrong with it
