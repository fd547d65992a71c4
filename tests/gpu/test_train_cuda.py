"""The training loop on one CUDA device: bf16 autocast over fp32 master weights, LoRA with bf16 base."""

from __future__ import annotations

import json

import pytest
import torch

from lstune.config.load import build_config
from lstune.train.run import train

pytestmark = pytest.mark.gpu


def _run(tmp_path, name, **flags):
    base = {"model": "tiny-llama", "data": "builtin:passkey", "seq_len": "1k", "max_steps": "4", "lr": "1e-3", "output_dir": str(tmp_path / name)}
    result = train(build_config({}, {**base, **flags}))
    lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
    return result, [json.loads(line) for line in lines]


def test_full_finetune_bf16_autocast_fp32_master(tmp_path):
    result, metrics = _run(tmp_path, "full")
    assert result.steps_done == 4
    assert all(torch.isfinite(torch.tensor(m["loss"])) for m in metrics)
    assert metrics[0]["peak_device_mem_bytes"] < torch.cuda.get_device_properties(0).total_memory
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "full" / "final")
    assert next(model.parameters()).dtype == torch.float32


def test_lora_on_cuda(tmp_path):
    result, metrics = _run(tmp_path, "lora", lora_r="8")
    assert result.steps_done == 4
    assert metrics[-1]["grad_norm"] > 0
