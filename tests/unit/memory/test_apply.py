"""apply_memory_techniques: validation, the plan, logging, undo; ensure_expandable_segments."""

from __future__ import annotations

import logging

import pytest
import torch

from lstune.errors import ConfigError, UserError
from lstune.memory.allocator import ensure_expandable_segments
from lstune.config.schema import MemorySection
from lstune.memory.apply import apply_memory_techniques
from lstune.memory.loss import causal_lm_loss_sum
from lstune.memory.tiling import TilePolicy
from lstune.models.introspect import decoder_layers
from lstune.models.presets import build_model
from tests.unit.memory._helpers import long_batch


def test_all_bad_settings_are_reported_at_once():
    with pytest.raises(ConfigError) as err:
        memory = MemorySection(tiled_mlp="off", tiled_loss=0, mini_sequence=True, checkpointing=False,
                               offload_checkpoints=True, host_mem_budget=-1)
        apply_memory_techniques(build_model("tiny-mistral"), memory, seq_len=0)
    problems = err.value.problems
    assert len(problems) == 5
    assert any("seq_len" in p for p in problems) and any("--tiled-loss" in p for p in problems)
    assert any("--mini-sequence" in p and "--tiled-mlp off" in p for p in problems)
    assert any("--host-mem-budget must be" in p for p in problems)
    assert any("--offload-checkpoints" in p and "--checkpointing on" in p for p in problems)


def test_applying_twice_is_refused_until_undone():
    model = build_model("tiny-mistral")
    plan = apply_memory_techniques(model, seq_len=64)
    with pytest.raises(UserError, match="already applied"):
        apply_memory_techniques(model, seq_len=64)
    plan.undo()
    apply_memory_techniques(model, seq_len=64).undo()


def test_undo_restores_every_module_and_the_same_numbers():
    model = build_model("tiny-gemma2")
    batch = long_batch(80)
    with torch.no_grad():
        before, _ = causal_lm_loss_sum(model, batch, tiles="off")
    plan = apply_memory_techniques(model, MemorySection(mini_sequence=True, offload_checkpoints=True), seq_len=80)
    patched = [m for m in model.modules() if "forward" in vars(m)]
    assert len(patched) == 2 * (1 + 1 + 2) + 1  # per layer: the layer, its MLP, two fused norms; the final norm
    plan.undo()
    assert not any("forward" in vars(m) for m in model.modules())
    with torch.no_grad():
        after, _ = causal_lm_loss_sum(model, batch)
    assert after.item() == before.item()


def test_plan_summary_and_loss_tiles_used_by_the_loss_head():
    model = build_model("tiny-qwen3")  # hidden 64, vocab 320
    plan = apply_memory_techniques(model, MemorySection(mini_sequence=True), seq_len=200)
    summary = plan.summary()
    assert summary["tiled_mlp"] == {"setting": "auto", "tiles": 4, "mini_sequence": True,
                                     "fused_norms": {0: ["post_attention_layernorm"], 1: ["post_attention_layernorm"]}}
    assert plan.loss_tiles == TilePolicy(count=5)  # MST: vocab / hidden
    assert summary["tiled_loss"] == {"setting": "5 tiles", "tiles": 5, "backend": "tiled", "final_norm_fused": True}
    assert summary["checkpointing"] and not summary["offload_checkpoints"]["enabled"]
    batch = long_batch(200)
    loss_sum, count = plan.loss_sum(model, batch)
    assert loss_sum.item() == pytest.approx(causal_lm_loss_sum(model, batch, tiles=TilePolicy(count=5))[0].item())
    plan.undo()
    assert not any("forward" in vars(m) for m in model.modules())


def test_every_patch_is_logged(caplog):
    model = build_model("tiny-mistral")
    with caplog.at_level(logging.DEBUG, logger="lstune"):
        plan = apply_memory_techniques(model, seq_len=128)
        plan.undo()
    text = caplog.text
    assert "patched MistralMLP.forward (layer 0: sequence-tiled)" in text
    assert "patched MistralDecoderLayer.forward (layer 1: checkpointed)" in text
    assert "restored MistralDecoderLayer.forward" in text and "memory plan:" in text


def test_lengths_whose_hidden_state_reaches_int32_are_flagged():
    model = build_model("tiny-mistral")  # hidden 64: 2^31 / 64 = 33.5M tokens
    plan = apply_memory_techniques(model, MemorySection(checkpointing=False), seq_len=2**31 // 64)
    assert any("2^31" in note for note in plan.notes)
    tile_len = -(-plan.seq_len // plan.mlp_tiles)
    assert tile_len * 160 < 2**31  # the MLP tiles themselves (intermediate 160) stay int32-safe
    plan.undo()


def test_techniques_reach_layers_through_a_peft_wrapper():
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(build_model("tiny-phi3"), LoraConfig(r=2, target_modules="all-linear"))
    plan = apply_memory_techniques(model, MemorySection(offload_checkpoints=True), seq_len=128)
    layers = decoder_layers(model)
    assert all("forward" in vars(layer) and "forward" in vars(layer.mlp) for layer in layers)
    plan.undo()


def test_expandable_segments_set_unless_the_user_configured_the_allocator(monkeypatch):
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    assert ensure_expandable_segments() is True
    import os

    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:256")
    assert ensure_expandable_segments() is False
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:256"


def test_the_model_tree_is_walked_once_for_its_parts(monkeypatch):
    """Given the parts, applying every technique (probes included) and a training step look nothing up again:
    no wrapper is unwrapped, no body or layer list searched, and each layer's MLP is found exactly once."""
    from lstune.models import introspect
    from lstune.models.introspect import find_parts

    model = build_model("tiny-llama", num_hidden_layers=3)
    parts = find_parts(model)
    calls = {name: 0 for name in ("unwrap_model", "decoder_body", "decoder_layers", "layer_mlp", "output_embedding")}
    for name in calls:
        original = getattr(introspect, name)

        def counting(*args, _name=name, _original=original, **kwargs):
            calls[_name] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(introspect, name, counting)
    memory = MemorySection(tiled_mlp=2, tiled_loss=2, mini_sequence=True, checkpointing=True)
    plan = apply_memory_techniques(model, memory, seq_len=32, parts=parts)
    plan.loss_sum(model, long_batch(32))[0].backward()
    plan.undo()
    assert plan.fused_norms, "mini-sequence's probe ran (norms fused), so the probes were exercised"
    assert calls == {"unwrap_model": 0, "decoder_body": 0, "decoder_layers": 0, "layer_mlp": 3, "output_embedding": 0}
