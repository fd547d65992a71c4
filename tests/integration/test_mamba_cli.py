"""Issue 34: attention-free models (Mamba, Mamba-2) through `lstune estimate` and `lstune train`: the estimate
answers (it refused them before: no byte model of a model without attention heads), a tiny run trains on the CPU,
and attention-only flags are refused with exit 2."""

from __future__ import annotations

import pytest

from tests.integration.conftest import read_metrics


@pytest.mark.parametrize("model", ["tiny-mamba", "tiny-mamba2"])
def test_the_estimate_answers_for_an_attention_free_model(cli, model):
    result = cli("estimate", "--model", model, "--seq-len", "4096", "--gpu", "h100-80gb")
    assert result.code == 0, result.err
    assert "verdict: fits" in result.out and "longest sequence that fits" in result.out
    assert "step (predicted)" in result.out and "state-space mixer" in result.out
    assert "attention in" not in result.out  # no chunked attention chosen by `auto`


@pytest.mark.parametrize("flag", [["--attn-chunks", "4"], ["--recompute-attention", "off"], ["--sp-ring", "2"]])
def test_attention_only_flags_are_refused_for_an_attention_free_model(cli, flag):
    result = cli("estimate", "--model", "tiny-mamba", "--seq-len", "4096", "--gpu", "h100-80gb", "--gpus", "2",
                 "--sp", "2", *flag)
    assert result.code == 2, (result.out, result.err)
    assert flag[0] in result.err and "attention" in result.err and "Traceback" not in result.err


@pytest.mark.parametrize("model", ["tiny-mamba", "tiny-mamba2"])
def test_a_tiny_attention_free_model_trains_on_the_cpu(cli, tmp_path, text_data, model):
    out = tmp_path / "run"
    result = cli("train", "--model", model, "--seq-len", "128", "--lr", "1e-3", "--warmup-steps", "0",
                 "--data", text_data, "--max-steps", "2", "--output-dir", out)
    assert result.code == 0, result.err
    losses = [row["loss"] for row in read_metrics(out) if "loss" in row]
    assert len(losses) == 2 and all(loss == loss and loss > 0 for loss in losses)


def test_the_presets_command_lists_the_attention_free_presets(cli):
    """`lstune presets` read each preset's attention heads and crashed (KeyError) on a preset without them."""
    result = cli("presets")
    assert result.code == 0, result.err
    assert "tiny-mamba " in result.out and "tiny-mamba2" in result.out
