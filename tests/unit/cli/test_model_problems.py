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
