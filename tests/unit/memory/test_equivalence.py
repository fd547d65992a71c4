"""Each memory technique alone and all together give plain HF's summed loss and every gradient (fp32, CPU).

Tile counts are forced above one and uneven (100 tokens in 3 tiles: 34, 34, 32) so a token dropped
or counted twice at a tile edge changes the loss sum by ~1 %, far above the 1e-5 tolerance.
"""

from __future__ import annotations

import pytest
import torch

from lstune.config.schema import MemorySection
from lstune.memory.apply import apply_memory_techniques
from lstune.models.presets import build_model
from tests.conftest import TINY_ARCHS
from tests.unit.memory._helpers import (
    assert_grads_match,
    hf_loss_sum,
    long_batch,
    packed_batch,
    run_grads,
    split_documents,
)

SEQ = 100
DOCS = [41, 33, 26]  # packed: 100 tokens
TECHNIQUES = {
    "tiled_mlp": dict(tiled_mlp=3, tiled_loss="off", checkpointing=False),
    "tiled_loss": dict(tiled_mlp="off", tiled_loss=3, checkpointing=False),
    "mini_sequence": dict(tiled_mlp=3, mini_sequence=True, checkpointing=False),
    "checkpointing": dict(tiled_mlp="off", tiled_loss="off", checkpointing=True),
    "offload": dict(tiled_mlp="off", tiled_loss="off", offload_checkpoints=True),
}
ALL = dict(tiled_mlp=3, tiled_loss=3, mini_sequence=True, offload_checkpoints=True)


@pytest.fixture(scope="module")
def models():
    """One fp32 model per architecture, in training mode, built once for the module."""
    cache = {}

    def get(arch: str):
        if arch not in cache:
            model = build_model(arch, seed=0)
            model.train()
            cache[arch] = model
        return cache[arch]

    return get


def _compare(model, batches, options, reference=None, scale=None):
    ref_loss, ref_grads = reference or run_grads(model, hf_loss_sum, batches, scale)
    plan = apply_memory_techniques(model, MemorySection(**options), seq_len=SEQ)
    try:
        loss, grads = run_grads(model, plan.loss_sum, batches, scale)
    finally:
        plan.undo()
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    assert_grads_match(grads, ref_grads)
    return plan


@pytest.mark.parametrize("technique", list(TECHNIQUES))
@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_each_technique_alone_matches_hf(models, arch, technique):
    _compare(models(arch), [long_batch(SEQ)], TECHNIQUES[technique])


@pytest.mark.parametrize("data", ["long", "packed"])
@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_all_techniques_together_match_hf(models, arch, data):
    batch = long_batch(SEQ) if data == "long" else packed_batch(DOCS)
    plan = _compare(models(arch), [batch], ALL)
    assert plan.mlp_tiles == 3 and plan.loss_tiles_at_seq_len == 3 and plan.offload


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_all_techniques_with_lora_match_hf(arch):
    from peft import LoraConfig, get_peft_model

    base = build_model(arch, seed=0)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False))
    model.train()
    plan = _compare(model, [packed_batch(DOCS)], ALL)
    assert all("lora_" in n for n, p in model.named_parameters() if p.requires_grad)
    assert plan.fused_norms, "mini-sequence found no norm to fuse through the peft wrapper"


def test_lora_on_the_lm_head_matches_hf():
    """An adapter on the output embedding runs inside the loss tiles and gets its gradient from them."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(
        build_model("tiny-llama", seed=0),
        LoraConfig(r=4, target_modules=["lm_head", "down_proj"], init_lora_weights=False),
    )
    model.train()
    _compare(model, [long_batch(SEQ)], ALL)


@pytest.mark.parametrize("arch", ["tiny-llama", "tiny-gemma2", "tiny-qwen3-moe"])
def test_packed_documents_match_separate_runs(models, arch):
    """Packed with all techniques == each document run on its own by plain HF (no cross-document attention)."""
    model = models(arch)
    packed = packed_batch(DOCS)
    reference = run_grads(model, hf_loss_sum, split_documents(packed, DOCS))
    _compare(model, [packed], ALL, reference=reference)


@pytest.mark.parametrize("arch", ["tiny-qwen3", "tiny-mixtral"])
def test_gradient_accumulation_matches_one_batch_of_two(models, arch):
    """Two micro-batches, each loss_sum / window tokens, == one batch of both rows / the same count."""
    model = models(arch)
    both = long_batch(SEQ, batch=2, seed=3)
    halves = [{k: v[i:i + 1] for k, v in both.items()} for i in range(2)]
    window_tokens = (both["shift_labels"] != -100).sum()
    reference = run_grads(model, hf_loss_sum, [both], scale=window_tokens)
    _compare(model, halves, ALL, reference=reference, scale=window_tokens)
    _compare(model, [both], ALL, reference=reference, scale=window_tokens)


def test_default_auto_policies_match_hf(models):
    """The defaults (auto tiles, checkpointing) at a length where auto cuts the MLP into 2 tiles."""
    model = models("tiny-mistral")
    plan = _compare(model, [long_batch(SEQ)], {})
    assert plan.mlp_tiles == 2 and plan.checkpointing and not plan.offload


def test_a_dropped_token_would_fail_the_comparison(models):
    """Guard that the tolerance is tight: ignoring one more label changes the sum beyond rel 1e-5."""
    model = models("tiny-llama")
    batch = long_batch(SEQ)
    dropped = {**batch, "shift_labels": batch["shift_labels"].clone()}
    dropped["shift_labels"][0, 50] = -100
    with torch.no_grad():
        full, _ = hf_loss_sum(model, batch)
        less, _ = hf_loss_sum(model, dropped)
    assert abs(full.item() - less.item()) / full.item() > 100 * 1e-5
