"""One optimizer step: the loss it reports is the exact mean over the window, and its gradient is the
gradient of that mean (grad accumulation over micro-batches of different label counts)."""

from __future__ import annotations

import copy
import dataclasses

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


def _unlabelled_window():
    window = _window()
    for batch in window:
        batch["shift_labels"].fill_(-100)
    return window


class _RecordingEngine:
    """An engine that records what the step asks of it (DeepSpeed's `skip_step` would apply an update on finite
    gradients, so a window with nothing to learn must reach neither method)."""

    def __init__(self, model):
        self.model, self.calls = model, []
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(torch.optim.SGD(model.parameters(), lr=1.0),
                                                           lambda step: 1.0 / (step + 1))

    def backward(self, loss):
        self.calls.append("backward")

    def step(self):
        self.calls.append("step")
        return {"grad_norm": 1.0, "lr": 1.0, "update_skipped": False}

    def skip_step(self):
        self.calls.append("skip_step")
        return {"grad_norm": float("nan"), "lr": 1.0, "update_skipped": False}


def test_a_window_without_labels_skips_its_update_and_is_not_divergence():
    from lstune.models.presets import build_model
    from lstune.train.guard import NonFiniteGuard

    config = build_config({}, {"grad_accum": "2", "micro_batch_size": "1"})
    engine = _RecordingEngine(build_model("tiny-llama", attn_implementation="sdpa"))
    forwards = []
    stepper = Stepper(config, engine, Runtime(torch.device("cpu"), None),
                      lambda batch, m: forwards.append(1) or hf_loss_sum(m, batch))
    state = RunState()
    record = stepper.step(iter(_unlabelled_window()), state)
    assert (engine.calls, forwards, engine.scheduler.last_epoch) == ([], [], 1)  # schedule advanced, nothing else
    assert (record["label_tokens"], record["update_skipped"], record["grad_norm"], record["lr"]) == (0, True, 0.0, 1.0)
    assert record["loss"] != record["loss"] and (state.step, state.consumed_samples, state.tokens_seen) == (1, 2, 96)
    note = NonFiniteGuard(skip=False).check(record, None)
    assert note.startswith("step 1: no token of this step's samples carries a loss") and "update was skipped" in note


def test_a_window_without_labels_leaves_adamw_weights_and_state_as_they_were():
    from lstune.models.presets import build_model

    model = build_model("tiny-llama", attn_implementation="sdpa")
    before = copy.deepcopy(model.state_dict())
    engine = TorchEngine(model, dataclasses.replace(OPTIM, weight_decay=0.1))
    config = build_config({}, {"grad_accum": "2", "micro_batch_size": "1"})
    stepper = Stepper(config, engine, Runtime(torch.device("cpu"), None), lambda batch, m: hf_loss_sum(m, batch))
    stepper.step(iter(_unlabelled_window()), RunState())
    assert engine.optimizer.state_dict()["state"] == {} and engine.scheduler.last_epoch == 1
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name
