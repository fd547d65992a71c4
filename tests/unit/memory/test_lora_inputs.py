"""LoRA adapters share the layer input under autocast, and recompute cast + dropout in backward: same numbers to
the bit as peft, fewer bytes saved."""

from __future__ import annotations

import contextlib

import pytest
import torch

from lstune.memory.lora_inputs import share_lora_inputs
from lstune.memory.patching import run_undos
from lstune.models.loading import apply_lora
from lstune.models.presets import build_model
from lstune.memory.measure import LiveBytes, SavedBytes
from tests.unit.memory._helpers import hf_loss_sum, long_batch, nonzero_lora_B


def _lora_model(dropout: float = 0.0):
    model = build_model("tiny-llama", dtype=torch.bfloat16)
    return apply_lora(model, r=4, alpha=None, dropout=dropout, targets="auto")


def _step(model, batch):
    model.zero_grad(set_to_none=True)
    with SavedBytes() as saved, torch.autocast("cpu", dtype=torch.bfloat16):
        loss, count = hf_loss_sum(model, batch)
    (loss / count).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return loss.item(), grads, saved.bytes


def test_bit_identical_under_autocast_and_fewer_saved_bytes():
    model = _lora_model()
    assert next(p for p in model.parameters() if p.requires_grad).dtype == torch.float32  # peft's fp32 adapters
    batch = long_batch(256)
    ref_loss, ref_grads, ref_bytes = _step(model, batch)
    undos = share_lora_inputs(model)
    patched = len(undos)
    try:
        loss, grads, saved = _step(model, batch)
    finally:
        run_undos(undos)
    assert patched == 4 * 7  # every linear layer of the 4 tiny layers (q, k, v, o, gate, up, down)
    assert loss == ref_loss
    for name, ref in ref_grads.items():
        assert torch.equal(grads[name], ref), name
    hidden, seq = model.config.hidden_size, 256
    # q/k/v/o and gate/up each kept a bf16 copy of their input per layer; at least the 4 attention ones go
    assert ref_bytes - saved >= 4 * 4 * seq * hidden * 2


def test_undo_restores_peft_and_nothing_changes_outside_autocast():
    model = _lora_model()
    layer = next(m for m in model.modules() if hasattr(m, "lora_A"))
    undos = share_lora_inputs(model)
    x = torch.ones(2, 3, dtype=torch.bfloat16)
    assert layer._cast_input_dtype(x, torch.float32).dtype == torch.float32  # no autocast: peft's cast
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert layer._cast_input_dtype(x, torch.float32) is x
    run_undos(undos)
    assert "_cast_input_dtype" not in vars(layer)


def _dropout_step(model, batch, bf16: bool):
    """Seeded forward + backward of the plain HF model: loss, every LoRA gradient, peak live bytes."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1234)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
    with LiveBytes() as live:
        with autocast:
            loss, count = hf_loss_sum(model, batch)
        (loss / count).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return loss.detach(), grads, live.peak


def _assert_same(a, b):
    assert torch.equal(a[0], b[0])
    assert a[1].keys() == b[1].keys()
    for name, ref in a[1].items():
        assert torch.equal(b[1][name], ref), name



@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16-autocast"])
def test_dropout_recomputed_bit_identical_to_peft(bf16):
    model = build_model("tiny-llama", dtype=torch.bfloat16 if bf16 else torch.float32)
    model = nonzero_lora_B(apply_lora(model, r=4, alpha=None, dropout=0.1, targets="auto"))
    model.train()
    batch = long_batch(256)
    ref = _dropout_step(model, batch, bf16)
    undos = share_lora_inputs(model)
    count = len(undos)
    try:
        patched = _dropout_step(model, batch, bf16)
        other_seed = (torch.manual_seed(99), hf_loss_sum(model, batch)[0].detach())[1]
    finally:
        run_undos(undos)
    assert count == 4 * 7
    _assert_same(ref, patched)
    assert not torch.equal(other_seed, ref[0])  # the loss does depend on the masks drawn: the check can fail
    _assert_same(ref, _dropout_step(model, batch, bf16))  # undone: peft's own forward, same numbers


def _lean_peak(dropout: float, seq: int = 1024) -> int:
    model = apply_lora(build_model("tiny-llama"), r=8, alpha=None, dropout=dropout, targets="auto")
    model.train()
    undos = share_lora_inputs(model)
    try:
        return _dropout_step(model, long_batch(seq), bf16=False)[2]
    finally:
        run_undos(undos)


def test_dropout_costs_no_activation_memory():
    without, lean = _lean_peak(0.0), _lean_peak(0.1)
    model = apply_lora(build_model("tiny-llama"), r=8, alpha=None, dropout=0.1, targets="auto")
    peft_peak = _dropout_step(model.train(), long_batch(1024), bf16=False)[2]
    assert peft_peak > 1.3 * without  # peft saves each adapter's dropout output and mask
    assert lean < 1.03 * without


def test_eval_mode_runs_peft_chain_unchanged():
    model = apply_lora(build_model("tiny-llama"), r=4, alpha=None, dropout=0.1, targets="auto")
    model.eval()
    batch = long_batch(128)
    with torch.no_grad():
        ref = hf_loss_sum(model, batch)[0]
        undos = share_lora_inputs(model)
        try:
            with SavedBytes() as saved:
                patched = hf_loss_sum(model, batch)[0]
            again = hf_loss_sum(model, batch)[0]
        finally:
            run_undos(undos)
    assert torch.equal(ref, patched) and torch.equal(patched, again)  # dropout is off: deterministic
    assert saved.bytes == 0


def test_undo_restores_peft_dropout_modules():
    model = apply_lora(build_model("tiny-llama"), r=4, alpha=None, dropout=0.1, targets="auto")
    layer = next(m for m in model.modules() if hasattr(m, "lora_A"))
    undos = share_lora_inputs(model)
    assert "forward" in vars(layer.lora_A["default"]) and "forward" in vars(layer.lora_dropout["default"])
    run_undos(undos)
    assert "forward" not in vars(layer.lora_A["default"])
    assert "forward" not in vars(layer.lora_dropout["default"])
    assert "_cast_input_dtype" not in vars(layer)


def _prepared_step(monkeypatch, lean: bool, memory: dict, bf16: bool = False):
    """One seeded step of the prepared model (lstune's techniques on), with or without the LoRA patches."""
    from lstune.config.schema import TrainConfig
    from lstune.train.prepare import prepare_model
    from lstune.train.runtime import Runtime

    if not lean:
        monkeypatch.setattr("lstune.memory.apply.share_lora_inputs", lambda model: [])
    config = TrainConfig.from_flat({"model": "tiny-llama", "seq_len": 256, "lora_r": 4, "lora_dropout": 0.1, **memory})
    prep = prepare_model(build_model("tiny-llama"), config, Runtime(torch.device("cpu"), None))
    nonzero_lora_B(prep.model)
    monkeypatch.undo()
    batch = long_batch(256)
    torch.manual_seed(4321)
    loss, count = prep.memory.loss_sum(prep.model, batch)
    (loss / count).backward()
    grads = {n: p.grad.clone() for n, p in prep.model.named_parameters() if p.requires_grad}
    return loss.detach(), grads


@pytest.mark.parametrize("memory", [
    {"checkpointing": True, "tiled_mlp": "off", "attn_chunks": 1},
    {"checkpointing": True, "tiled_mlp": 4, "attn_chunks": 4},
    {"checkpointing": False, "tiled_mlp": 4, "attn_chunks": 4},
], ids=["checkpointing", "all-three", "tiles-and-chunks"])
def test_dropout_recompute_nests_in_lstune_recompute(monkeypatch, memory):
    """Layer checkpointing, tiled MLP and attention chunks replay the RNG; the nested region replays its own."""
    _assert_same(_prepared_step(monkeypatch, False, memory), _prepared_step(monkeypatch, True, memory))


def test_auto_targets_leave_out_linear_layers_with_a_forward_of_their_own():
    """PhiMoE's router is an nn.Linear whose forward returns routing tuples: peft's "all-linear" wrapped it and the
    model's own forward broke (found by tests/support/arch_sweep.py). 'auto' leaves such layers out."""
    from tests.support.archs import tiny_model

    model = apply_lora(tiny_model("phimoe"), r=4, alpha=8, dropout=0.0, targets="auto")
    wrapped = {name for name, module in model.named_modules() if hasattr(module, "lora_A")}
    assert wrapped and not any("router" in name for name in wrapped)
    assert any("experts" in name or "q_proj" in name for name in wrapped)
    loss_sum, _ = hf_loss_sum(model, long_batch(16))
    loss_sum.backward()  # the forward and backward run
