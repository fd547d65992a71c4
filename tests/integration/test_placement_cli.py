"""The checkpoint placement (MEMO) in `lstune train`'s printed plan, and its bad values' exit 2."""

from __future__ import annotations

from tests.integration.conftest import TINY_MODEL

ONE = 256 * 128 * 4  # one fp32 tiny-llama checkpoint at 256 tokens


def test_train_prints_the_placement(cli, tmp_path, text_data):
    result = cli("train", *TINY_MODEL, "--data", text_data, "--max-steps", "1", "--output-dir", tmp_path / "run",
                 "--offload-checkpoints", "--host-mem-budget", str(2 * ONE), "--checkpoint-device-budget", str(4 * ONE))
    assert result.code == 0, result.err
    flat = " ".join(result.out.split())
    assert "checkpoint placement: host 0-1; device 2-3 (host 0.2 MiB, device 0.2 MiB, recompute +0.0%" in flat, flat


def test_a_bad_checkpoint_device_budget_exits_2(cli, tmp_path, text_data):
    result = cli("train", *TINY_MODEL, "--data", text_data, "--output-dir", tmp_path / "run",
                 "--checkpointing", "off", "--checkpoint-device-budget", "1G")
    assert result.code == 2 and "Traceback" not in result.err
    assert "--checkpoint-device-budget places activation checkpoints: it needs --checkpointing on" in result.err
