"""LongRoPE (Phi-3) with --pack in one process: each packed document gets the factors of its own length, as the
model run on that document alone (lstune/models/rope_documents.py). Plain HF on the packed row gives every
document the long factors as soon as one passes the original context."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.distributed.test_longrope_sp import LONGROPE, longrope_model
from tests.unit.memory._helpers import (
    hf_loss_sum,
    packed_batch,
    run_grads,
    split_documents,
)

DOCS = [40, 20, 36]  # past, within and past the original 32 positions


def _rotary(model):
    return next(m for m in model.modules() if getattr(m, "rope_type", None) == "longrope")


def test_document_lengths_follow_position_restarts():
    from lstune.models.rope_documents import document_lengths

    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3], [0, 1, 2, 3, 4, 5, 6, 7, 8]])
    assert document_lengths(positions).tolist() == [[3, 3, 3, 2, 2, 4, 4, 4, 4], [9] * 9]


def test_each_document_gets_the_rotary_embedding_of_its_own_length():
    from lstune.models.rope_documents import per_document_longrope

    model = longrope_model()
    rotary = _rotary(model)
    x = torch.zeros(1, 1, 8)
    alone = [rotary(x, torch.arange(n)[None]) for n in DOCS]  # what the model computes for each document alone
    expected = [torch.cat([a[i] for a in alone], dim=1) for i in (0, 1)]
    packed = torch.cat([torch.arange(n) for n in DOCS])[None]
    unpatched = rotary(x, packed)
    assert not torch.equal(unpatched[0], expected[0])  # the row's long factors reach the short document
    handle = per_document_longrope(model)
    assert handle.modules == 1
    cos, sin = rotary(x, packed)
    assert torch.equal(cos, expected[0]) and torch.equal(sin, expected[1])
    handle.undo()
    assert torch.equal(rotary(x, packed)[0], unpatched[0])


@pytest.mark.parametrize("patched", [True, False])
def test_packed_loss_and_gradients_equal_each_document_alone(patched):
    from lstune.memory.loss import causal_lm_loss_sum
    from lstune.models.attention import use_lstune_attention
    from lstune.models.rope_documents import per_document_longrope

    base = longrope_model()
    batch = packed_batch(DOCS)
    n = int((batch["shift_labels"] != -100).sum())
    ref_loss, ref_grads = run_grads(copy.deepcopy(base), hf_loss_sum, split_documents(batch, DOCS), scale=n)
    model = copy.deepcopy(base)
    use_lstune_attention(model, backend="sdpa")  # packed documents apart, from position_ids
    if patched:
        per_document_longrope(model)
    loss, grads = run_grads(model, lambda m, b: causal_lm_loss_sum(m, b)[:2], [batch], scale=n)
    worst = max(float((grads[k] - g).abs().max() / g.abs().max().clamp_min(1e-12)) for k, g in ref_grads.items())
    exact = abs(loss - ref_loss) <= 1e-5 * abs(ref_loss) and worst < 1e-4
    assert exact == patched, (loss, ref_loss, worst)


@pytest.mark.parametrize("patched", [True, False])
def test_the_self_check_probe_packs_documents_on_both_sides_of_the_original_context(patched, monkeypatch):
    from lstune.config.schema import DataSection, MemorySection, TrainConfig
    from lstune.errors import ModelError
    from lstune.models import rope_documents
    from lstune.train import self_check
    from lstune.train.runtime import Runtime

    if not patched:  # the row's choice for every document, as transformers makes it
        monkeypatch.setattr(rope_documents, "per_document_longrope", lambda model: rope_documents.RopeDocumentsHandle([]))
    batch = self_check.probe_batch(longrope_model().config, pack=True, sp=1, vocab=320)
    lengths = rope_documents.document_lengths(batch["position_ids"])[0]
    assert lengths.max() > 32 >= lengths.min()
    config = TrainConfig(data=DataSection(pack=True), memory=MemorySection(attn_chunks="off"))
    if patched:
        result = self_check.run_self_check(longrope_model(), config, Runtime(torch.device("cpu"), None))
        assert result.ok and result.documents == 2 and result.loss_rel < 1e-5
    else:
        with pytest.raises(ModelError):
            self_check.run_self_check(longrope_model(), config, Runtime(torch.device("cpu"), None))


def test_pack_past_the_original_context_is_refused_only_under_sp_naming_the_fixes():
    from lstune.errors import ModelError
    from lstune.models.rope import apply_rope_scaling
    from tests.support.archs import tiny_config

    config = tiny_config("phi3", **LONGROPE)
    apply_rope_scaling(config, "none", "auto", seq_len=64, pack=True)  # one process: made exact
    with pytest.raises(ModelError, match=r"--pack with --sp 2: .*LongRoPE.*Use --sp 1, drop --pack, or use "
                                         r"--seq-len 32 or less"):
        apply_rope_scaling(config, "none", "auto", seq_len=64, pack=True, sp=2)
    config.rope_parameters = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}
    with pytest.raises(ModelError, match=r"--pack: .*dynamic RoPE.*Drop --pack, or use --seq-len"):
        apply_rope_scaling(config, "none", "auto", seq_len=256, pack=True)
