"""One optimizer step: the loss it reports is the exact mean over the window, and its gradient is the
gradient of that mean (grad accumulation over micro-batches of different label counts)."""

from __future__ import annotations

import copy

import pytest
import torch

from lstune.config.load import build_config
from lstune.optim import OptimConfig
from lstune.train.engine import TorchEngine
from lstune.train.runtime import Runtime
from lstune.train.step import RunState, Stepper
from tests.unit.memory._helpers import hf_loss_sum, long_batch

OPTIM = OptimConfig(lr=1e-2, weight_decay=0.0, betas=(0.9, 0.95), eps=1e-8, warmup_steps=0, max_steps=3,
                    schedule="constant", min_lr_ratio=0.0, max_grad_norm=0.0)


def _window():
    return [long_batch(48, seed=1, ignore_every=3), long_batch(48, seed=2, ignore_every=7)]


def test_a_step_reports_the_window_mean_and_applies_its_gradient():
    from lstune.models.presets import build_model

    model = build_model("tiny-llama", attn_implementation="sdpa")
    reference = copy.deepcopy(model)
    config = build_config({}, {"grad_accum": "2", "micro_batch_size": "1"})
    runtime = Runtime(torch.device("cpu"), None)
    stepper = Stepper(config, TorchEngine(model, OPTIM), runtime, lambda batch, m: hf_loss_sum(m, batch))
    state = RunState()
    record = stepper.step(iter(_window()), state)

    sums, counts = zip(*(hf_loss_sum(reference, b) for b in _window()))
    mean = sum(sums) / sum(counts)
    assert record["loss"] == pytest.approx(mean.item(), rel=1e-6)
    assert (record["step"], record["label_tokens"], record["tokens"]) == (1, int(sum(counts)), 96)
    assert (state.step, state.consumed_samples, state.tokens_seen) == (1, 2, 96)

    mean.backward()
    expected = torch.optim.AdamW(reference.parameters(), lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    expected.step()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
