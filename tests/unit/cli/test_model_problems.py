"""`model_problems`: what a run refuses from the config and the model's config alone, shared by `train --dry-run`
and `lstune bench` so their verdicts are the run's."""

from __future__ import annotations

import pytest

from lstune.cli.train import model_problems
from lstune.config.schema import TrainConfig


def _problems(**flat) -> list[str]:
    config = TrainConfig.from_flat({"model": "tiny-llama", **flat})
    assert not config.problems()  # each case below passes the config's own checks
    return model_problems(config, device="cpu")


@pytest.mark.parametrize("flat", [{}, {"gpus": 2, "sp": "auto"}, {"gpus": 2, "sp": 2, "rope_scaling": "yarn"},
                                  {"lora_r": 16}])
def test_what_the_run_accepts_passes(flat):
    assert _problems(**flat) == []


@pytest.mark.parametrize("flat, words", [
    ({"gpus": 2, "sp": 3}, ["--sp 3 does not fit 2 process(es)", "use one of 1, 2"]),
    ({"gpus": 2, "sp": 2, "rope_scaling": "dynamic"}, ["--rope-scaling dynamic", "--sp 1"]),
    ({"lora_r": 16, "load_in_4bit": True}, ["--load-in-4bit", "initialised at random"]),
    ({"lora_r": 16, "load_in_4bit": True, "init": "random"}, ["--load-in-4bit", "drop --load-in-4bit"]),
])
def test_what_the_run_refuses_before_loading_is_found_from_the_config(flat, words):
    problems = _problems(**flat)
    assert len(problems) == 1 and all(w in problems[0] for w in words), problems


def test_a_model_that_does_not_resolve_is_the_only_problem_named():
    config = TrainConfig.from_flat({"model": "./no/such/folder", "gpus": 2, "sp": 3})
    problems = model_problems(config, device="cpu")
    assert len(problems) == 1 and "./no/such/folder" in problems[0], problems


def test_a_resume_under_another_parallel_layout_is_refused_before_launch(tmp_path):
    """--resume of a ring or METP checkpoint under another layout: the launching process finds it from the
    checkpoint's records and the plan's dims, with the ranks' message (lstune.train.preflight.check_resume_layout),
    before any process starts; the checkpoint's other records are checked first, as the ranks check them."""
    from lstune.train.checkpoint import save_checkpoint

    ring = {"world_size": 2, "sp": 2, "ring": 2, "metp_mlp": False, "attn_chunks": 2}
    save_checkpoint(tmp_path / "ring", 2, write_state=lambda folder: None,
                    train_state={"config": {"model": "tiny-llama"}, "layout": ring})
    same = {"gpus": 2, "sp": 2, "sp_ring": 2, "attn_chunks": 2, "output_dir": str(tmp_path / "ring"),
            "resume": "latest"}
    assert _problems(**same) == []
    for other, words in (({"sp_ring": 1}, "--sp-ring 2 (now 1)"), ({"attn_chunks": "off"}, "--attn-chunks 2 (now off)"),
                         ({"gpus": 1, "sp": 1, "sp_ring": 1}, "--gpus (processes) 2 (now 1)")):
        problems = _problems(**{**same, **other})
        assert len(problems) == 1 and "another parallel layout" in problems[0] and words in problems[0], problems
    (tmp_path / "hosts").write_text("node-1 slots=2\n")  # a --hostfile's world is learned in the ranks: checked there
    assert _problems(**{**same, "sp_ring": 1, "hostfile": str(tmp_path / "hosts")}) == []

    metp = {"world_size": 2, "sp": 2, "ring": 1, "metp_mlp": True}
    save_checkpoint(tmp_path / "metp", 2, write_state=lambda folder: None,
                    train_state={"config": {"model": "tiny-llama"}, "layout": metp})
    run = {"gpus": 2, "sp": 2, "output_dir": str(tmp_path / "metp"), "resume": "latest"}
    assert _problems(**run, metp_mlp=True) == []
    problems = _problems(**run)
    assert len(problems) == 1 and "--metp-mlp True (now False)" in problems[0], problems
    problems = _problems(**{**run, "model": "tiny-qwen3"})  # another model: the ranks' first refusal, alone
    assert len(problems) == 1 and "--model is 'tiny-qwen3'" in problems[0], problems
    assert _problems(gpus=2, sp=2, output_dir=str(tmp_path / "new"), resume="auto") == []  # nothing to resume yet
