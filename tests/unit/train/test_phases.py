"""The phases a long step reports: forward layer i/L, then backward, then the optimizer."""

from __future__ import annotations

import torch

from lstune.config.load import build_config
from lstune.models.presets import build_model
from lstune.train.phases import PhaseTracker
from lstune.train.prepare import prepare_model
from lstune.train.runtime import Runtime
from tests.unit.memory._helpers import long_batch


def test_forward_and_backward_report_each_layer_and_hooks_come_off():
    model = build_model("tiny-llama", attn_implementation="sdpa")
    prepared = prepare_model(model, build_config({}, {"seq_len": "64"}), Runtime(torch.device("cpu"), None))
    seen: list[str] = []
    tracker = PhaseTracker(seen.append, prepared.parts.layers, min_interval=0.0)
    n = len(prepared.parts.layers)
    tracker.set("forward")
    loss, count = prepared.loss_sum(long_batch(64))
    tracker.set("backward")
    (loss / count).backward()
    tracker.set("optimizer")
    assert seen[: n + 1] == ["forward"] + [f"forward layer {i}/{n}" for i in range(1, n + 1)]
    assert seen[n + 1:] == ["backward", "optimizer"], "the checkpointed recompute is not reported as a forward"
    tracker.remove()
    seen.clear()
    prepared.loss_sum(long_batch(64))
    assert seen == []


def test_reports_are_rate_limited_but_phase_changes_always_pass():
    seen: list[str] = []
    layers = torch.nn.ModuleList([torch.nn.Identity() for _ in range(3)])
    tracker = PhaseTracker(seen.append, layers, min_interval=3600)
    tracker.set("forward")
    for layer in layers:
        layer(torch.zeros(1))
    tracker.set("backward")
    assert seen == ["forward", "backward"]
