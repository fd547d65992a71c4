"""LoRA adapters share the layer input under autocast: same numbers to the bit, fewer bytes saved."""

from __future__ import annotations

import torch

from lstune.memory.lora_inputs import share_lora_inputs
from lstune.memory.patching import run_undos
from lstune.models.loading import apply_lora
from lstune.models.presets import build_model
from lstune.memory.measure import SavedBytes
from tests.unit.memory._helpers import hf_loss_sum, long_batch


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


def test_layers_with_dropout_keep_peft_cast():
    assert share_lora_inputs(_lora_model(dropout=0.1)) == []
