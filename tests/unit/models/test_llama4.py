"""Llama-4 (llama4_text) exact with packed documents and chunked attention (FPDT): loss and every gradient equal plain
HF eager, each packed document run alone, fp32 on CPU.

The tiny config has a rotary layer with chunked attention in 12-token chunks (crossed by every document, and not
aligned with FPDT's chunks of 24/24/22 tokens) and a NoPE layer whose attention temperature steps every 4 positions
(floor_scale=4, attn_scale=1): a temperature read from the token's index in the module's input instead of its position
(transformers' own code, which lstune.models.llama4 replaces) changes the packed documents' and each FPDT chunk's.
"""

from __future__ import annotations

import pytest
import torch

from lstune.config.schema import MemorySection
from lstune.errors import ModelError
from lstune.memory.apply import apply_memory_techniques
from lstune.memory.block_attention import block_attention
from lstune.memory.loss import causal_lm_loss_sum
from lstune.models import llama4
from lstune.models.attention import use_lstune_attention
from tests.support.archs import tiny_model
from tests.unit.memory._helpers import (
    assert_grads_match, hf_loss_sum, long_batch, nonzero_lora_B, packed_batch, run_grads, split_documents)

SEQ = 70
DOCS = [29, 24, 17]
CONFIG = dict(attention_chunk_size=12, floor_scale=4, attn_scale=1.0)
MEMORY = {
    "attention": None,
    "chunked": dict(attn_chunks=3, tiled_mlp="off", tiled_loss="off", checkpointing=False),
    "all": dict(attn_chunks=3, tiled_mlp=3, tiled_loss=3, mini_sequence=True, offload_checkpoints=True),
    "checkpointing": dict(tiled_mlp=2, tiled_loss="off", checkpointing=True),
}


def _model(**extra):
    return tiny_model("llama4_text", **{**CONFIG, **extra})


def _batch(data: str):
    return long_batch(SEQ) if data == "long" else packed_batch(DOCS)


def _reference(data: str, **extra):
    """Plain HF eager: the long sample whole, each packed document alone."""
    batch = _batch(data)
    pieces = [batch] if data == "long" else split_documents(batch, DOCS)
    return run_grads(_model(**extra), hf_loss_sum, pieces)


def _lstune(model, data: str, memory: dict | None):
    attention = use_lstune_attention(model, backend="sdpa", block_kernel=block_attention)
    plan = None
    try:
        step = causal_lm_loss_sum
        if memory is not None:
            plan = apply_memory_techniques(model, MemorySection(**memory), seq_len=SEQ)
            step = plan.loss_sum
            if memory.get("attn_chunks"):
                assert plan.attn_chunks_at_seq_len == memory["attn_chunks"]
        return run_grads(model, step, [_batch(data)])
    finally:
        if plan is not None:
            plan.undo()
        attention.undo()


def _assert_exact(got, reference) -> None:
    assert got[0] == pytest.approx(reference[0], rel=1e-5)
    assert_grads_match(got[1], reference[1])


@pytest.mark.parametrize("memory", list(MEMORY))
@pytest.mark.parametrize("data", ["long", "packed"])
def test_llama4_matches_hf_each_document_alone(data, memory):
    _assert_exact(_lstune(_model(), data, MEMORY[memory]), _reference(data))


def test_llama4_multimodal_text_layers_are_adapted_too():
    """Llama4ForConditionalGeneration's language model has the same attention class: found and probed there."""
    from transformers import AutoConfig, Llama4ForConditionalGeneration

    text = dict(vocab_size=320, hidden_size=32, intermediate_size=64, intermediate_size_mlp=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=2,
                interleave_moe_layer_step=1, no_rope_layers=[1, 0], **CONFIG)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, image_size=28,
                  patch_size=14, vision_output_dim=32, projector_input_dim=32, projector_output_dim=32)
    config = AutoConfig.for_model("llama4", text_config=text, vision_config=vision)
    model = Llama4ForConditionalGeneration(config)
    handle = llama4.install_llama4_attention(model)
    try:
        assert len(handle.names) == 2
        assert all(isinstance(vars(attn)["forward"], llama4.Llama4Attention)
                   for _, _, attn in llama4.llama4_attention_sites(model))
    finally:
        handle.undo()
    assert not any("forward" in vars(attn) for _, _, attn in llama4.llama4_attention_sites(model))


def test_llama4_with_lora_matches_hf():
    from lstune.models.loading import apply_lora

    def build():
        return nonzero_lora_B(apply_lora(_model(), r=4, alpha=8, dropout=0.0, targets="auto"))

    batch = _batch("packed")
    reference = run_grads(build(), hf_loss_sum, split_documents(batch, DOCS))
    assert any("lora_A" in name and "self_attn" in name for name in reference[1])
    _assert_exact(_lstune(build(), "packed", MEMORY["chunked"]), reference)


def test_a_temperature_from_the_token_index_would_fail(monkeypatch):
    """Mutation: transformers' rule (the index in the module's input) in place of the positions. The probe refuses it
    at install; with the probe off, the packed comparison fails (so the test above can fail)."""
    own = llama4.temperature
    monkeypatch.setattr(llama4, "temperature", lambda positions, *rest: own(None, *rest))
    with pytest.raises(ModelError, match="differs from .*self_attn's own forward"):
        use_lstune_attention(_model(), backend="sdpa", block_kernel=block_attention)
    monkeypatch.setattr(llama4, "probe_llama4_attention", lambda *args: None)
    with pytest.raises(AssertionError):
        _assert_exact(_lstune(_model(), "packed", None), _reference("packed"))


def test_positions_not_handed_to_attention_would_fail(monkeypatch):
    """Mutation: without the hooks the attention sees no position_ids, so packed documents are refused as before."""
    from lstune.models import position_hooks

    monkeypatch.setattr(position_hooks, "hand_on_positions", lambda source, targets: [])
    with pytest.raises(ModelError, match="does not pass position_ids"):
        _lstune(_model(), "packed", None)


def test_probe_crosses_a_floor_scale_step_from_a_nonzero_position(monkeypatch):
    seen = []
    original = llama4._SeenTokens
    monkeypatch.setattr(llama4, "_SeenTokens", lambda start: seen.append(start) or original(start))
    for floor_scale, start in ((4, 4), (8192, 8180)):
        seen.clear()
        llama4.install_llama4_attention(_model(floor_scale=floor_scale)).undo()
        assert seen == [start] * 2  # two kinds of layer: rotary with qk-norm, NoPE with the temperature


def test_undo_restores_the_module_and_its_hooks():
    model = _model()
    sites = llama4.llama4_attention_sites(model)
    assert len(sites) == 2
    hooks = [(len(layer._forward_pre_hooks), len(attn._forward_pre_hooks)) for _, layer, attn in sites]
    handle = use_lstune_attention(model, backend="sdpa", block_kernel=block_attention)
    assert all("forward" in vars(attn) for _, _, attn in sites)
    handle.undo()
    assert not any("forward" in vars(attn) for _, _, attn in sites)
    assert hooks == [(len(layer._forward_pre_hooks), len(attn._forward_pre_hooks)) for _, layer, attn in sites]
    # the plain model again: HF's own (index-based) temperature on the long sample, as before
    _assert_exact(run_grads(model, hf_loss_sum, [_batch("long")]), _reference("long"))


def test_a_changed_attention_class_is_refused_by_name():
    model = _model()
    del model.model.layers[1].self_attn.floor_scale
    with pytest.raises(ModelError, match=r"Llama4TextAttention model\.layers\.1\.self_attn .*floor_scale"):
        use_lstune_attention(model, backend="sdpa", block_kernel=block_attention)


def test_generation_with_a_cache_runs_the_modules_own_forward():
    model = _model().eval()
    handle = llama4.install_llama4_attention(model)
    try:
        ids = torch.randint(3, 320, (1, 6), generator=torch.Generator().manual_seed(0))
        out = model.generate(ids, max_new_tokens=3, do_sample=False)
    finally:
        handle.undo()
    assert torch.equal(out, model.generate(ids, max_new_tokens=3, do_sample=False))


@pytest.mark.parametrize("sp, chunks", [(2, 1), (4, 1), (2, 2), (4, 2), (2, 3)])
def test_every_ranks_view_passes_the_chunk_mask_check(sp, chunks):
    """The chunked mask is checked on each SP rank's own tokens (transformers builds it there): contiguous shards that
    start mid-chunk, and FPDT's pieces, whose positions jump — also where the chunk positions happen to continue by
    +1 across the jump (positions ..., 8, 9 then 46, 47 with 12-token chunks: 46 % 12 = 10)."""
    model = _model()
    use_lstune_attention(model, backend="sdpa", block_kernel=block_attention)
    seq = 96
    piece = seq // (sp * chunks)
    gen = torch.Generator().manual_seed(sp * 10 + chunks)
    layouts = [[seq], [37, 59], [22, 10, 14, 50], [10, 36, 50]]
    layouts += [torch.randperm(seq - 1, generator=gen)[:4].add(1).sort().values.diff(prepend=torch.tensor([0]),
                append=torch.tensor([seq])).tolist() for _ in range(4)]
    for docs in layouts:
        positions = torch.cat([torch.arange(n) for n in docs if n])
        for rank in range(sp):
            local = torch.cat([positions[piece * (rank + k * sp):piece * (rank + k * sp + 1)] for k in range(chunks)])
            with torch.no_grad():
                model(input_ids=torch.randint(3, 300, (1, len(local))), position_ids=local[None], use_cache=False)
