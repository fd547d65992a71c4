"""`lstune train --load-in-4bit` end to end on CPU (bitsandbytes' CPU backend), and its refusals."""

from __future__ import annotations

import pytest

from tests.integration.conftest import TINY, read_metrics


def test_qlora_run_on_cpu(cli, tmp_path, text_data):
    pytest.importorskip("bitsandbytes")
    from lstune.models.presets import build_model

    folder = tmp_path / "model"
    build_model("tiny-llama").save_pretrained(folder)
    out = tmp_path / "run"
    result = cli("train", "--model", folder, "--load-in-4bit", "--lora-r", "4", "--data", text_data, "--seq-len", "256",
                 "--max-steps", "2", "--output-dir", out)
    assert result.code == 0, result.err
    assert "self-check passed" in result.out and "4-layer copy" in result.out  # the 4-bit model itself
    assert len(read_metrics(out)) == 2 and (out / "final" / "adapter_config.json").is_file()


def test_qlora_on_a_preset_is_refused(cli, tmp_path):
    result = cli("train", *TINY, "--load-in-4bit", "--lora-r", "4", "--output-dir", tmp_path / "run")
    assert result.code == 2, result.err
    assert "--load-in-4bit quantizes pretrained weights" in result.err and "Traceback" not in result.err
