"""Validation under SP on gloo processes: the eval loss and the passkey accuracy equal one process's, with answers
on either shard and one straddling the shard boundary (counted per sample across the SP group, then over DP)."""

from __future__ import annotations

import pytest

FLAGS = {"seq_len": "96", "tiled_loss": "3", "tiled_mlp": "2"}


def _evaluate(rank: int, world: int, sp: int, samples: list) -> dict:
    from types import SimpleNamespace

    import torch

    from lstune.config.load import build_config
    from lstune.models.presets import build_model
    from lstune.train.evaluate import Evaluator
    from lstune.train.prepare import prepare_model
    from lstune.train.runtime import Runtime

    model = build_model("tiny-llama", attn_implementation="sdpa")
    runtime = Runtime(torch.device("cpu"), None, launch=SimpleNamespace(rank=rank, world_size=world))
    runtime.set_dims(sp, model.config)
    prepared = prepare_model(model, build_config({}, {**FLAGS, "sp": str(sp)}), runtime)
    return Evaluator(samples, prepared.eval_sums, runtime, passkey=True).run(prepared.model)


@pytest.mark.parametrize(("world", "sp"), [(2, 2), (4, 2)])
def test_passkey_accuracy_and_eval_loss_under_sp_equal_one_process(pools, world, sp):
    import torch

    from lstune.config.load import build_config
    from lstune.models.presets import build_model
    from lstune.train.evaluate import Evaluator
    from lstune.train.prepare import prepare_model
    from lstune.train.runtime import Runtime
    from tests.unit.train.test_evaluate import answer_samples

    model = build_model("tiny-llama", attn_implementation="sdpa")
    # Shards of 48 tokens: answers at 60-65 (rank 1, right), 20-24 (rank 0, wrong), 44-51 (both ranks, right), and
    # a fourth and fifth sample so that DP ranks get unequal shares (a blank sample pads the short one).
    samples = answer_samples(model, spans=((60, 66), (20, 25), (44, 52), (45, 49), (40, 47)))
    samples[3]["shift_labels"][47] = (samples[3]["shift_labels"][47] + 1) % 320  # wrong on rank 0's side only
    prepared = prepare_model(model, build_config({}, FLAGS), Runtime(torch.device("cpu"), None))
    one = Evaluator(samples, prepared.eval_sums, Runtime(torch.device("cpu"), None), passkey=True).run(prepared.model)
    assert one["eval_passkey_acc"] == pytest.approx(3 / 5)
    for result in pools[world].run(_evaluate, sp, samples):
        assert result["eval_passkey_acc"] == pytest.approx(3 / 5)
        assert result["eval_tokens"] == one["eval_tokens"]
        assert result["eval_loss"] == pytest.approx(one["eval_loss"], rel=1e-5)
