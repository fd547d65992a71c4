"""gpt-oss (learned attention sinks, alternating 16-token sliding windows, an MoE that returns its router scores)
through lstune on one process: chunked attention (FPDT, sinks applied once after the chunks' merge) and LoRA with
every memory technique, long and packed — the loss and every gradient equal plain HF eager (each packed document run
alone). The matrix (test_model_matrix.py) covers lstune's attention alone and each memory technique; SP is in
tests/distributed/test_sinks_sp.py."""

from __future__ import annotations

import copy
import functools

import pytest
import torch

from tests.support.archs import tiny_model
from tests.unit.memory._helpers import (
    assert_grads_match,
    hf_loss_sum,
    long_batch,
    nonzero_lora_B,
    packed_batch,
    run_grads,
    run_with_plan,
    split_documents,
)

SEQ = 72
DOCS = [31, 23, 18]
CHUNKED = dict(attn_chunks=3, tiled_mlp="off", tiled_loss="off", checkpointing=False)
EVERYTHING = dict(attn_chunks=3, tiled_mlp=3, tiled_loss=3, mini_sequence=True, offload_checkpoints=True)


@functools.cache
def _model(lora: bool):
    model = tiny_model("gpt_oss")
    with torch.no_grad():  # sinks of either sign and size, so that a dropped or misplaced sink shows
        for name, param in model.named_parameters():
            if name.endswith("sinks"):
                param.copy_(torch.randn(param.shape, generator=torch.Generator().manual_seed(5)) * 2)
    if lora:
        from lstune.models.loading import apply_lora

        model = nonzero_lora_B(apply_lora(model, r=4, alpha=8, dropout=0.0, targets="auto"))
    return model


def _batches(data: str):
    if data == "long":
        batch = long_batch(SEQ)
        return batch, [batch]
    batch = packed_batch(DOCS)
    return batch, split_documents(batch, DOCS)


@pytest.mark.parametrize("data", ["long", "packed"])
@pytest.mark.parametrize("options,lora", [(CHUNKED, False), (EVERYTHING, False), (EVERYTHING, True)],
                         ids=["chunked", "everything", "lora_everything"])
def test_gpt_oss_matches_hf_eager(options, lora, data):
    batch, pieces = _batches(data)
    reference = run_grads(copy.deepcopy(_model(lora)), hf_loss_sum, pieces)
    model = copy.deepcopy(_model(lora))
    plan, loss, grads = run_with_plan(model, options, SEQ, [batch])
    assert plan.attn_chunks_at_seq_len == 3
    assert loss == pytest.approx(reference[0], rel=1e-5)
    assert any(name.endswith("sinks") for name in grads) != lora  # LoRA freezes them
    assert_grads_match(grads, reference[1])


def test_the_sinks_change_the_result():
    """The sinks matter at these sizes: with them pushed to -30 (no sink) the reference loss moves by far more than
    the tests' tolerance (so a dropped sink fails them)."""
    batch, pieces = _batches("long")
    model = copy.deepcopy(_model(False))
    loss = run_grads(model, hf_loss_sum, pieces)[0]
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("sinks"):
                param.fill_(-30.0)
    assert abs(run_grads(model, hf_loss_sum, pieces)[0] - loss) > 1e-4 * abs(loss)
