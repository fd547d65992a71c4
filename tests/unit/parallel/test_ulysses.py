"""Ulysses registration in one process (SP=1: no collectives, everything else of the wrapper runs)."""

from __future__ import annotations

import pytest
import torch

from lstune.errors import DataError, ModelError
from lstune.models.hf_internals import attention_implementation
from lstune.models.presets import build_model
from lstune.parallel.dims import ParallelDims
from lstune.parallel.ulysses import UlyssesAttention, apply_ulysses
from tests.distributed._helpers import loss_sum, make_batch


def test_sp1_wrapper_matches_plain_model_and_undo_restores_it():
    batch = make_batch(40, docs=3)
    model = build_model("tiny-mistral", attn_implementation="sdpa")
    plain, _ = loss_sum(model, batch)
    handle = apply_ulysses(model, ParallelDims(1, 1))
    assert attention_implementation(model.config).startswith("lstune_")
    wrapped, _ = loss_sum(model, batch)
    handle.undo()
    assert attention_implementation(model.config) == "sdpa"
    torch.testing.assert_close(wrapped, plain, rtol=1e-6, atol=1e-5)


def test_mask_only_kernel_is_refused():
    with pytest.raises(ModelError, match="mask"):
        apply_ulysses(build_model("tiny-llama"), ParallelDims(1, 1), core="eager")


def test_position_blind_kernel_refuses_packed_documents():
    model = build_model("tiny-llama", num_hidden_layers=1, attn_implementation="sdpa")
    handle = apply_ulysses(model, ParallelDims(1, 1), core="sdpa")
    loss_sum(model, make_batch(32, docs=1))  # one document per row: HF SDPA with is_causal is right
    with pytest.raises(DataError, match="document-aware"):
        loss_sum(model, make_batch(32, docs=3))
    handle.undo()


def test_missing_position_ids_is_a_data_error():
    attention = UlyssesAttention(lambda *a, **k: None, "lstune", ParallelDims(1, 1))
    q = torch.zeros(1, 2, 4, 8)
    with pytest.raises(DataError, match="position_ids"):
        attention(object(), q, q, q, None)


def test_sp_above_one_needs_process_groups():
    with pytest.raises(RuntimeError, match="build_groups"):
        apply_ulysses(build_model("tiny-llama"), ParallelDims(2, 2))
