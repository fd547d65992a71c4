"""Exact or refused, on many architectures: loss and every gradient vs plain Hugging Face (fp32, CPU).

For each tiny random-init architecture of tests/support/archs.py (>= 20 model types), lstune's attention (sdpa) alone
and with each memory technique, and with all of them together, on one long sample and on packed documents, either
matches the reference — HF with its own eager attention and mask on the long sample; each document run alone on the
packed one — or is refused with the expected message. Windows (16 tokens) are shorter than the sequences (70 tokens),
so a window that is dropped changes the result. A model that passes here silently wrong fails this test.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch

from lstune.errors import ModelError
from tests.support.archs import ARCHS, refusal, tiny_model
from lstune.memory.loss import causal_lm_loss_sum as lstune_step
from tests.unit.memory._helpers import hf_loss_sum, long_batch, packed_batch, run_grads, split_documents

SEQ = 70
DOCS = [29, 24, 17]
TECHNIQUES = {
    "attention": None,
    "tiled_mlp": dict(tiled_mlp=3, tiled_loss="off", checkpointing=False),
    "tiled_loss": dict(tiled_mlp="off", tiled_loss=3, checkpointing=False),
    "mini_sequence": dict(tiled_mlp=3, mini_sequence=True, tiled_loss="off", checkpointing=False),
    "checkpointing_offload": dict(tiled_mlp="off", tiled_loss="off", offload_checkpoints=True),
    "all": dict(tiled_mlp=3, tiled_loss=3, mini_sequence=True, offload_checkpoints=True),
}


@functools.cache
def _reference(model_type: str, data: str):
    model = tiny_model(model_type)
    if data == "long":
        batch = long_batch(SEQ)
        return batch, run_grads(model, hf_loss_sum, [batch])
    batch = packed_batch(DOCS)
    return batch, run_grads(model, hf_loss_sum, split_documents(batch, DOCS))


def _assert_close(got, ref) -> None:
    loss, grads = got
    ref_loss, ref_grads = ref
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    assert grads.keys() == ref_grads.keys()
    # Gradients that are zero in exact arithmetic (a key bias under softmax) are compared at the model's scale.
    scale = max(float(g.abs().max()) for g in ref_grads.values())
    for name, ref in ref_grads.items():
        atol = 1e-5 * max(float(ref.abs().max()), 1e-3 * scale)
        torch.testing.assert_close(grads[name], ref, rtol=1e-4, atol=atol, msg=lambda m: f"{name}: {m}")


def _apply(model, technique: str, data: str):
    """Install lstune's attention (and the techniques); returns the loss step: the plan's, or the untiled one."""
    from lstune.config.schema import MemorySection
    from lstune.memory.apply import apply_memory_techniques
    from lstune.memory.block_attention import block_attention
    from lstune.models.attention import use_lstune_attention
    from lstune.models.introspect import find_parts
    from lstune.train.mixers import install_mixers

    parts = find_parts(model)
    install_mixers(parts.body, parts.layers, pack=data == "packed")
    use_lstune_attention(model, backend="sdpa", block_kernel=block_attention)
    if TECHNIQUES[technique] is None:
        return lstune_step
    return apply_memory_techniques(model, MemorySection(**TECHNIQUES[technique]), seq_len=SEQ).loss_sum


def _expected_refusal(model_type: str, technique: str, data: str) -> str | None:
    """A regex of the refusals this case may get (the first check to run wins), None when it must be exact."""
    cases = ["attention"]
    if data == "packed":
        cases.append("pack")
    if technique in ("tiled_mlp", "mini_sequence", "all"):
        cases.append("tiled_mlp")
    patterns = [refusal(model_type, case) for case in cases if refusal(model_type, case)]
    return "|".join(patterns) or None


@pytest.mark.parametrize("technique", list(TECHNIQUES))
@pytest.mark.parametrize("data", ["long", "packed"])
@pytest.mark.parametrize("model_type", list(ARCHS))
def test_exact_or_refused(model_type, data, technique):
    batch, reference = _reference(model_type, data)
    model = copy.deepcopy(tiny_model(model_type))
    expected = _expected_refusal(model_type, technique, data)
    if expected:
        with pytest.raises(ModelError, match=expected):
            step = _apply(model, technique, data)
            run_grads(model, step, [batch])
        return
    step = _apply(model, technique, data)
    _assert_close(run_grads(model, step, [batch]), reference)


def test_the_matrix_covers_at_least_20_architectures():
    assert len(ARCHS) >= 20


@pytest.mark.parametrize("model_type", ["qwen2_moe", "mistral", "gemma3_text"])
def test_a_dropped_window_would_fail_the_matrix(model_type, monkeypatch):
    """The windows really cut: with lstune's window forced off, the comparison fails."""
    from lstune.models import attention

    batch, reference = _reference(model_type, "long")
    model = copy.deepcopy(tiny_model(model_type))
    monkeypatch.setattr(attention, "window_from_mask", lambda *args: None)
    step = _apply(model, "attention", "long")
    with pytest.raises(AssertionError):
        _assert_close(run_grads(model, step, [batch]), reference)


def test_a_block_called_with_more_than_the_hidden_states_is_refused_at_apply_time():
    """BLOOM's MLP takes the residual too: refused when tiling is applied, not in the first step."""
    from lstune.config.schema import MemorySection
    from lstune.memory.apply import apply_memory_techniques

    model = tiny_model("bloom")
    with pytest.raises(ModelError, match=r"BloomMLP is called with more than the hidden states \(residual\)"):
        apply_memory_techniques(model, MemorySection(tiled_mlp=3), seq_len=SEQ)
    assert not any("forward" in vars(layer.mlp) for layer in model.transformer.h)  # nothing left patched


def test_a_per_token_argument_reaching_a_tiled_block_is_refused():
    """The guard at call time: an optional argument shaped like the tokens would reach every tile whole."""
    from lstune.memory.mlp import TiledForward
    from lstune.memory.tiling import TilePolicy

    block = torch.nn.Linear(8, 8)
    tiled = TiledForward(block, TilePolicy(count=2))
    x = torch.randn(1, 6, 8)
    assert tiled(x).shape == x.shape
    with pytest.raises(ModelError, match="per-token tensor argument"):
        tiled(x, torch.randn(1, 6, 8))
