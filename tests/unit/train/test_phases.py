"""The phases a long step reports: forward layer 1..L, then backward layer L..1, then the optimizer."""

from __future__ import annotations

import pytest
import torch

from lstune.config.load import build_config
from lstune.models.presets import build_model
from lstune.train.phases import PhaseTracker
from lstune.train.prepare import prepare_model
from lstune.train.runtime import Runtime
from tests.unit.memory._helpers import long_batch


@pytest.mark.parametrize("checkpointing", ["on", "off"])
def test_forward_and_backward_report_each_layer_and_hooks_come_off(checkpointing):
    model = build_model("tiny-llama", attn_implementation="sdpa")
    config = build_config({}, {"seq_len": "64", "checkpointing": checkpointing})
    prepared = prepare_model(model, config, Runtime(torch.device("cpu"), None))
    seen: list[str] = []
    tracker = PhaseTracker(seen.append, prepared.parts.layers, min_interval=0.0)
    n = len(prepared.parts.layers)
    tracker.set("forward")
    loss, count = prepared.loss_sum(long_batch(64))
    tracker.set("backward")
    (loss / count).backward()
    tracker.set("optimizer")
    assert seen[: n + 1] == ["forward"] + [f"forward layer {i}/{n}" for i in range(1, n + 1)]
    # Layer by layer, last first; the checkpointed recompute is not reported as a forward.
    assert seen[n + 1:] == ["backward"] + [f"backward layer {i}/{n}" for i in range(n, 0, -1)] + ["optimizer"]
    grads = {name: p.grad.clone() for name, p in prepared.model.named_parameters()}
    tracker.remove()
    seen.clear()
    prepared.model.zero_grad()
    loss, count = prepared.loss_sum(long_batch(64))
    (loss / count).backward()
    assert seen == []
    for name, p in prepared.model.named_parameters():
        assert torch.equal(p.grad, grads[name]), f"the gradient hooks changed {name}'s gradient"


def test_eval_reports_each_layer_without_autograd():
    model = build_model("tiny-llama", attn_implementation="sdpa")
    prepared = prepare_model(model, build_config({}, {"seq_len": "64"}), Runtime(torch.device("cpu"), None))
    seen: list[str] = []
    tracker = PhaseTracker(seen.append, prepared.parts.layers, min_interval=0.0)
    tracker.set("eval")
    with torch.no_grad():
        prepared.loss_sum(long_batch(64))
    n = len(prepared.parts.layers)
    assert seen == ["eval"] + [f"eval layer {i}/{n}" for i in range(1, n + 1)]
    tracker.remove()


def test_reports_are_rate_limited_but_phase_changes_always_pass():
    seen: list[str] = []
    layers = torch.nn.ModuleList([torch.nn.Identity() for _ in range(3)])
    tracker = PhaseTracker(seen.append, layers, min_interval=3600)
    tracker.set("forward")
    for layer in layers:
        layer(torch.zeros(1))
    tracker.set("backward")
    assert seen == ["forward", "backward"]
