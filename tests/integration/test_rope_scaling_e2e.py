"""`lstune train --rope-scaling`: the saved final/ reproduces the scaled positions; the warning without it."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from lstune.models.presets import preset_config
from tests.integration.conftest import read_metrics


def short_model(tmp_path):
    """A local model folder (config only) pretrained, it says, at 64 positions."""
    config = preset_config("tiny-llama")
    config.max_position_embeddings = 64
    folder = tmp_path / "short-llama"
    config.save_pretrained(folder)
    return folder


def logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_yarn_run_saves_a_model_that_reloads_with_the_same_positions(cli, tmp_path, text_data):
    out = tmp_path / "run"
    result = cli("train", "--model", short_model(tmp_path), "--init", "random", "--data", text_data, "--seq-len",
                 "256", "--rope-scaling", "yarn", "--max-steps", "2", "--output-dir", out)
    assert result.code == 0, result.err
    assert "RoPE scaling yarn, factor 4 over 64 original positions" in result.out
    assert "warning" not in result.out
    assert len(read_metrics(out)) == 2

    reloaded = AutoModelForCausalLM.from_pretrained(out / "final")
    assert reloaded.config.rope_parameters["rope_type"] == "yarn"
    # The same weights under the config transformers' documentation gives for YaRN x4 over 64 positions.
    expected = LlamaConfig(**{**reloaded.config.to_dict(), "max_position_embeddings": 256, "rope_parameters": {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": 10000.0}})
    reference = AutoModelForCausalLM.from_config(expected)
    reference.load_state_dict(reloaded.state_dict())
    unscaled = AutoModelForCausalLM.from_config(LlamaConfig(**{**expected.to_dict(), "rope_parameters": None,
                                                               "max_position_embeddings": 64}))
    unscaled.load_state_dict(reloaded.state_dict())
    ids = torch.randint(3, 300, (1, 200))
    torch.testing.assert_close(logits(reloaded, ids), logits(reference, ids), rtol=0, atol=0)
    assert not torch.allclose(logits(reloaded, ids), logits(unscaled, ids), atol=1e-4)


def test_training_past_the_positions_warns_with_the_fix(cli, tmp_path, text_data):
    result = cli("train", "--model", short_model(tmp_path), "--init", "random", "--data", text_data, "--seq-len",
                 "128", "--max-steps", "1", "--output-dir", tmp_path / "run")
    assert result.code == 0, result.err
    assert "--seq-len 128 is beyond the 64 positions" in result.out
    assert "--rope-scaling yarn" in result.out
