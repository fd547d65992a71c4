"""The prepared model: parts found once, the loss head reads its plan from it, and undo → reapply works
(what `lstune bench` does between configurations)."""

from __future__ import annotations

import torch

from lstune.config.load import build_config
from lstune.models.hf_internals import attention_implementation
from lstune.models.presets import build_model
from lstune.train.prepare import apply_techniques, prepare_model
from lstune.train.runtime import Runtime
from tests.unit.memory._helpers import hf_loss_sum, long_batch


def _runtime() -> Runtime:
    return Runtime(torch.device("cpu"), None)


def test_apply_undo_reapply_keeps_the_numbers_and_the_model():
    model = build_model("tiny-qwen3", attn_implementation="sdpa")
    batch = long_batch(96)
    with torch.no_grad():
        reference, _ = hf_loss_sum(model, batch)
    config = build_config({}, {"seq_len": "96", "tiled_mlp": "3", "tiled_loss": "4", "offload_checkpoints": True})
    prepared = prepare_model(model, config, _runtime())
    assert prepared.memory.loss_tiles == 4 and prepared.memory.mlp_tiles == 3
    assert attention_implementation(prepared.model.config) == prepared.attention.key
    with torch.no_grad():
        first, count = prepared.loss_sum(batch)
    torch.testing.assert_close(first, reference, rtol=1e-5, atol=1e-5)

    prepared.undo()
    assert not any("forward" in vars(m) for m in model.modules())
    assert attention_implementation(model.config) == "sdpa"

    again = apply_techniques(prepared.model, build_config({}, {"seq_len": "96", "mini_sequence": True}), _runtime())
    with torch.no_grad():
        second, _ = again.loss_sum(batch)
    torch.testing.assert_close(second, reference, rtol=1e-5, atol=1e-5)
    again.undo()


def test_parts_are_found_once_per_preparation(monkeypatch):
    from lstune.models import introspect

    calls = []
    original = introspect.decoder_layers
    monkeypatch.setattr(introspect, "decoder_layers", lambda m: calls.append(1) or original(m))
    prepared = prepare_model(build_model("tiny-llama"), build_config({}, {"seq_len": "64"}), _runtime())
    prepared.loss_sum(long_batch(64))
    assert len(calls) == 1
    prepared.undo()
