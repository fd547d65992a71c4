"""`--mini-sequence auto` (the default) is the estimate's choice, like offload and chunks: off while the run fits
without, on where it makes the run fit — before chunked attention, the dearer technique. Llama-3.1-8B LoRA on one
H100 80 GB with a 128 GiB host, AdamW on the device and offloaded checkpoints: 384K tokens do not fit with tiled MLP
and loss alone (the norms' fp32 temporaries and the loss head), fit with mini-sequence's fused norms and MST loss
tiles — where, before it was `auto`, the estimate cut the attention into 4 chunks."""

from __future__ import annotations

import pytest

from lstune.config.schema import TrainConfig
from lstune.estimate import estimate
from lstune.estimate.hardware import resolve_hardware

GiB = 2**30
K = 1024


def _estimate(seq_len: int, **flat):
    config = TrainConfig.from_flat({"model": "llama-3.1-8b", "seq_len": seq_len, "lora_r": 16,
                                    "offload_checkpoints": True, "zero_stage": "0", **flat})
    return estimate(config, resolve_hardware(gpu="h100-80gb", host_mem=128 * GiB), suggest=False)


def test_auto_is_the_default_and_stays_off_while_the_run_fits_without():
    assert TrainConfig().memory.mini_sequence == "auto"
    e = _estimate(128 * K)
    assert e.fits and e.memory_choice.mini_sequence is False
    assert "mini-sequence" not in e.memory_choice.describe()
    assert e.memory_choice.applied_to(TrainConfig()).memory.mini_sequence is False


def test_auto_turns_it_on_where_the_run_does_not_fit_without_and_before_chunks():
    without = _estimate(384 * K, mini_sequence=False, attn_chunks="off")
    assert not without.fits and without.fits_host  # the device is the limit
    assert _estimate(384 * K, mini_sequence=False).memory_choice.attn_chunks == 4  # chunks alone: 4 of them
    e = _estimate(384 * K)
    choice = e.memory_choice
    assert e.fits and choice.mini_sequence is True and choice.attn_chunks == "off"
    assert "mini-sequence: it does not fit the device without" in choice.describe()
    assert choice.to_dict()["mini_sequence"] is True
    assert choice.applied_to(TrainConfig.from_flat({"seq_len": 384 * K})).memory.mini_sequence is True
    # The same prediction as asking for it outright.
    forced = _estimate(384 * K, mini_sequence=True)
    assert forced.device_peak_bytes == e.device_peak_bytes and forced.memory_choice.mini_sequence is True
    # Longer, both: mini-sequence and the fewest chunks that fit with it — 8 within the margin a chunked run keeps
    # (13 % of the device, issue 32); 4 fitted the device to the byte before it.
    both = _estimate(512 * K).memory_choice
    assert both.mini_sequence is True and both.attn_chunks == 8


def test_auto_reaches_longer_sequences_than_off():
    assert _estimate(128 * K).longest_seq_len > _estimate(128 * K, mini_sequence=False).longest_seq_len


def test_tiled_mlp_off_keeps_it_off_and_forcing_both_is_refused():
    e = _estimate(512 * K, tiled_mlp="off")
    assert e.memory_choice.mini_sequence is False
    assert not TrainConfig.from_flat({"tiled_mlp": "off"}).problems()  # auto with the MLP untiled: simply off
    problems = TrainConfig.from_flat({"tiled_mlp": "off", "mini_sequence": True}).problems()
    assert any("--mini-sequence tiles the MLP" in p for p in problems)


@pytest.mark.parametrize("flag, value", [("--mini-sequence", True), ("--no-mini-sequence", False)])
def test_the_flags_set_it_outright(flag, value):
    from typer.main import get_command

    from lstune.cli.app import app
    from lstune.config.load import build_config

    command = get_command(app).commands["train"]
    ctx = command.make_context("train", [flag], resilient_parsing=True)
    assert build_config({}, {"mini_sequence": ctx.params["mini_sequence"]}).memory.mini_sequence is value


def test_unresolved_auto_is_off_in_the_memory_plan():
    """Where no estimate resolved it (a bench ladder rung, a direct call), `auto` applies nothing, like offload."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from lstune.config.schema import MemorySection
    from lstune.memory.apply import apply_memory_techniques

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2, vocab_size=64))
    plan = apply_memory_techniques(model, MemorySection(), seq_len=64)
    try:
        assert plan.mini_sequence is False
    finally:
        plan.undo()
    plan = apply_memory_techniques(model, MemorySection(mini_sequence=True), seq_len=64)
    try:
        assert plan.mini_sequence is True
    finally:
        plan.undo()
