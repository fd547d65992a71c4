"""Token mixers that are not attention with packed documents (one process): loss and every gradient equal plain HF
with each document run alone (fp32), for every family transformers ships with a short convolution or a recurrent
state; the probe, the refusals and the undo. SP is in tests/distributed/test_mixers_sp.py."""

from __future__ import annotations

import copy

import pytest
import torch

from lstune.errors import ModelError
from lstune.memory.loss import causal_lm_loss_sum
from lstune.models import mixers
from lstune.models.attention import use_lstune_attention
from lstune.models.introspect import find_parts
from lstune.train.mixers import install_mixers
from tests.support.archs import MIXER_ARCHS, tiny_model
from tests.unit.memory._helpers import hf_loss_sum, long_batch, packed_batch, run_grads, split_documents

SEQ = 70
DOCS = [29, 24, 17]
# Attention-free models on the sweep's generic tiny configs (tests/support/arch_sweep.py) as well as MIXER_ARCHS'.
SWEEP_TYPES = ["mamba", "falcon_mamba"]


def _assert_close(got, ref) -> None:
    loss, grads = got
    ref_loss, ref_grads = ref
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    assert grads.keys() == ref_grads.keys()
    scale = max(float(g.abs().max()) for g in ref_grads.values())
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-4, atol=1e-5 * max(float(g.abs().max()), 1e-3 * scale),
                                   msg=lambda m: f"{name}: {m}")


def _packed_against_each_document(model) -> None:
    batch = packed_batch(DOCS)
    reference = run_grads(copy.deepcopy(model), hf_loss_sum, split_documents(batch, DOCS))
    parts = find_parts(model)
    handle = install_mixers(parts.body, parts.layers, pack=True)
    assert handle is not None and handle.names
    use_lstune_attention(model, backend="sdpa")
    _assert_close(run_grads(model, causal_lm_loss_sum, [batch]), reference)


@pytest.mark.parametrize("model_type", list(MIXER_ARCHS))
def test_packed_documents_are_exact(model_type):
    _packed_against_each_document(tiny_model(model_type))


@pytest.mark.parametrize("model_type", SWEEP_TYPES)
def test_packed_documents_are_exact_for_families_without_an_sp_plan(model_type):
    from tests.support import arch_sweep

    model, problem = arch_sweep.build(model_type)
    assert model is not None, problem  # the sweep's config builds: a skip would hide the check
    _packed_against_each_document(model)


def test_packed_documents_are_exact_with_lora():
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1)
    config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0, init_lora_weights=False)
    _packed_against_each_document(get_peft_model(tiny_model("qwen3_next"), config))


def test_without_lstune_the_packed_documents_leak():
    """The comparison can fail: the plain model on the packed row differs from each document alone."""
    model = tiny_model("qwen3_next")
    batch = packed_batch(DOCS)
    reference = run_grads(copy.deepcopy(model), hf_loss_sum, split_documents(batch, DOCS))
    use_lstune_attention(model, backend="sdpa")
    with pytest.raises(AssertionError):
        _assert_close(run_grads(model, causal_lm_loss_sum, [batch]), reference)


def test_one_long_sample_is_unchanged():
    model = tiny_model("bamba")
    batch = long_batch(SEQ)
    reference = run_grads(copy.deepcopy(model), hf_loss_sum, [batch])
    parts = find_parts(model)
    install_mixers(parts.body, parts.layers, pack=True)
    use_lstune_attention(model, backend="sdpa")
    _assert_close(run_grads(model, causal_lm_loss_sum, [batch]), reference)


def test_undo_restores_every_mixer_and_the_hook():
    model = tiny_model("qwen3_next")
    parts = find_parts(model)
    hooks = dict(parts.body._forward_pre_hooks)
    handle = install_mixers(parts.body, parts.layers, pack=True)
    module = parts.layers[0].linear_attn
    assert isinstance(vars(module)["forward"], mixers.DocumentMixer)
    handle.undo()
    assert "forward" not in vars(module)
    assert dict(parts.body._forward_pre_hooks) == hooks


def test_nothing_is_installed_for_one_sample_on_one_process():
    parts = find_parts(tiny_model("qwen3_next"))
    assert install_mixers(parts.body, parts.layers, pack=False) is None


def test_the_probe_refuses_a_wrong_per_document_run(monkeypatch):
    monkeypatch.setattr(mixers, "_per_document", lambda run, x, spans: run(x))  # documents ignored
    parts = find_parts(tiny_model("lfm2"))
    with pytest.raises(ModelError, match=r"layers\.0\.conv \(Lfm2ShortConv\) differs from its own forward"):
        install_mixers(parts.body, parts.layers, pack=True)
    assert "forward" not in vars(parts.layers[0].conv)  # undone on refusal


class _UnknownMixer(torch.nn.Module):
    """A convolution-owning mixer of no family lstune knows."""

    def __init__(self):
        super().__init__()
        self.conv1d = torch.nn.Conv1d(4, 4, 3, groups=4, padding=2)
        self.proj = torch.nn.Linear(4, 4)


def test_a_mixer_without_a_head_parallel_plan_is_refused_under_sp_with_its_name():
    layer = torch.nn.Module()
    layer.mixer = _UnknownMixer()
    layers = torch.nn.ModuleList([layer])
    mixers.check_token_mixers(layers, pack=True, sp=1)
    with pytest.raises(ModelError, match=r"layers\.0\.mixer \(_UnknownMixer\).*--sp 1"):
        mixers.check_token_mixers(layers, pack=False, sp=2)


def test_every_sp_family_is_recognised_structurally():
    names = {t: {mixers.family_of(m).name for _, m in mixers.mixer_sites(find_parts(tiny_model(t)).layers)}
             for t in MIXER_ARCHS}
    assert names == {"qwen3_next": {"Gated DeltaNet"}, "qwen3_5_text": {"Gated DeltaNet"},
                     "qwen3_5_moe_text": {"Gated DeltaNet"}, "bamba": {"Mamba-2"}, "granitemoehybrid": {"Mamba-2"},
                     "falcon_h1": {"Mamba-2"}, "nemotron_h": {"Mamba-2"}, "lfm2": {"ShortConv"},
                     "kimi_linear": {"KDA"}, "jamba": {"Mamba-1"}, "mamba": {"Mamba-1"}, "falcon_mamba": {"Mamba-1"},
                     "mamba2": {"Mamba-2"}, "minimax": {"lightning attention"}}


def test_a_cached_call_is_refused():
    model = tiny_model("lfm2")
    parts = find_parts(model)
    install_mixers(parts.body, parts.layers, pack=True)
    with pytest.raises(ModelError, match="cache"):
        parts.layers[0].conv(torch.zeros(1, 4, 32), cache=object())


def test_a_meta_model_gets_its_mixers_without_a_probe():
    """The estimator's models have no values: the mixers are installed (their memory is traced), the probe skipped."""
    from transformers import AutoModelForCausalLM

    from tests.support.archs import tiny_config

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(tiny_config("qwen3_next"))
    parts = find_parts(model)
    assert install_mixers(parts.body, parts.layers, pack=True).names == ["layers.0.linear_attn"]


# Gathered shards (every rank's, in rank order): 8 tokens on 2 ranks as FPDT's pieces of 2 tokens with 2 chunks per rank
# (rank r holds pieces r and r + 2) and as a ring of 2's zigzag (ring position r holds pieces r and 3 − r); 16 tokens
# on 2 Ulysses × 2 ring ranks (SP rank 2·r + u holds half u of ring position r's two pieces of 4).
GATHERED = {"fpdt": (2, 1, 2, [0, 1, 4, 5, 2, 3, 6, 7]), "ring": (2, 2, None, [0, 1, 6, 7, 2, 3, 4, 5]),
            "contiguous": (2, 1, None, list(range(8))),
            "ring-2x2": (4, 2, None, [0, 1, 2, 3, 12, 13, 14, 15, 4, 5, 6, 7, 8, 9, 10, 11])}


@pytest.mark.parametrize("layout", list(GATHERED))
def test_the_shard_order_puts_the_gathered_shards_in_time_order(layout):
    """What the head-parallel mixers do after the all-to-all: the gathered tokens in global order, and back."""
    from lstune.models.chunk_layout import AttentionChunks

    sp, ring, chunks, gathered = GATHERED[layout]
    order = mixers.ShardOrder(sp, ring, AttentionChunks(chunks) if chunks else None)
    if layout == "contiguous":
        assert order.gathered_index(len(gathered) // sp, "cpu") is None
    x = torch.tensor([gathered]).unsqueeze(-1) * 10
    assert order.to_global(x)[0, :, 0].tolist() == [10 * i for i in range(len(gathered))]
    assert torch.equal(order.to_gathered(order.to_global(x)), x)


def test_a_shard_not_laid_out_for_the_ring_is_refused():
    from lstune.errors import DataError

    with pytest.raises(DataError, match=r"3-token shard on 2 ranks is not laid out for ring attention.s zigzag"
                                        r".*SPDataAdapter"):
        mixers.ShardOrder(2, 2).layout(3)


def test_the_mixers_follow_chunked_attentions_layout_under_sp():
    """prepare hands the memory plan's chunking to the mixers (their order follows it); nothing in one process."""
    from types import SimpleNamespace

    from lstune.models.chunk_layout import AttentionChunks
    from lstune.train.mixers import MixersHandle
    from lstune.train.prepare import _follow_attention_layout

    chunks = AttentionChunks(setting=2)
    handle = MixersHandle(["layers.0.linear_attn"], [], [], mixers.ShardOrder(2), probe=False)
    _follow_attention_layout(handle, SimpleNamespace(attn_chunking=chunks))
    assert handle.order.chunks is chunks and handle.order.describe() == "chunked attention's pieces (2 chunks)"
    alone = MixersHandle(["layers.0.linear_attn"], [], [], mixers.ShardOrder(1), probe=False)
    _follow_attention_layout(alone, SimpleNamespace(attn_chunking=chunks))
    assert alone.order.chunks is None


def test_too_few_mixer_heads_for_the_whole_sp_group_of_a_ring_are_refused():
    """Under a ring the mixers split their heads over the whole SP group (Ulysses × ring), which may exceed them."""
    from types import SimpleNamespace

    from lstune.parallel.ulysses import SequenceExchange

    dims = SimpleNamespace(sp=8, sp_rank=0, sp_group=None, ring=2, ulysses=4, ulysses_rank=0, ulysses_group=None)
    exchange = SequenceExchange(dims)
    assert (exchange.sp, exchange.ring) == (8, 2)
    assert SequenceExchange(dims, ulysses_only=True).sp == 4
    layers = find_parts(tiny_model("qwen3_next")).layers  # 6 key heads
    with pytest.raises(ModelError, match=r"SP degree 8 is larger than the 6 heads of layers\.0\.linear_attn "
                                         r"\(Qwen3NextGatedDeltaNet\).*--sp-ring 2.*use --sp 6 or less"):
        mixers.check_token_mixers(layers, pack=False, sp=8, exchange=exchange)


def test_granitemoehybrid_layers_get_position_ids_and_the_hooks_undo():
    """Its decoder layers drop position_ids: lstune's attention hands them on (the packed comparison above fails
    without), and undoing lstune's attention removes the hooks."""
    model = tiny_model("granitemoehybrid")
    layer = find_parts(model).layers[1]
    seen = []
    layer.self_attn.register_forward_pre_hook(lambda m, a, k: seen.append(k.get("position_ids")), with_kwargs=True)
    positions = torch.tensor([[0, 1, 2, 0, 1, 2]])
    model(input_ids=torch.zeros(1, 6, dtype=torch.long), position_ids=positions)
    assert seen[-1] is None
    handle = use_lstune_attention(model, backend="sdpa")
    model(input_ids=torch.zeros(1, 6, dtype=torch.long), position_ids=positions)
    assert torch.equal(seen[-1], positions)
    handle.undo()
    model(input_ids=torch.zeros(1, 6, dtype=torch.long), position_ids=positions)
    assert seen[-1] is None


ALL_TECHNIQUES = dict(tiled_mlp=3, tiled_loss=3, mini_sequence=True, offload_checkpoints=True)
_NEMOTRON_EVERY_BLOCK = dict(hybrid_override_pattern="M*-E", num_hidden_layers=4, n_routed_experts=4,
                             num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
                             moe_shared_expert_intermediate_size=32, n_group=1, topk_group=1)


@pytest.mark.parametrize(("model_type", "extra", "tiled"), [
    ("mamba", {}, (None, None)), ("falcon_mamba", {}, (None, None)), ("mamba2", {}, (None, None)),
    # Nemotron-H: one part per block (Mamba, attention, MLP, MoE): only the MLP and MoE blocks are tiled
    ("nemotron_h", _NEMOTRON_EVERY_BLOCK, (None, None, "mixer", "mixer")),
], ids=["mamba", "falcon_mamba", "mamba2", "nemotron_h"])
def test_mlp_tiling_skips_blocks_of_a_mixer_alone_with_packing(model_type, extra, tiled):
    """Every memory technique with packed documents equals plain HF on each document alone: MLP tiling (and
    mini-sequence) leave the blocks whose only part is a token mixer to the per-document mixer (taking the mixer for
    the block's MLP ran it on tiles, which the mixer refused)."""
    from lstune.config.schema import MemorySection
    from lstune.memory.apply import apply_memory_techniques
    from lstune.memory.mlp import TiledForward

    model = tiny_model(model_type, **extra)
    batch = packed_batch(DOCS)
    reference = run_grads(copy.deepcopy(model), hf_loss_sum, split_documents(batch, DOCS))
    parts = find_parts(model)
    assert parts.mlp_names == tiled
    install_mixers(parts.body, parts.layers, pack=True, lm=parts.lm)
    use_lstune_attention(model, backend="sdpa")
    plan = apply_memory_techniques(model, MemorySection(**ALL_TECHNIQUES), seq_len=SEQ, parts=parts)
    patched = [isinstance(vars(getattr(layer, name)).get("forward"), TiledForward) if name else
               not any(isinstance(vars(m).get("forward"), TiledForward) for m in layer.modules())
               for layer, name in zip(parts.layers, tiled)]
    assert all(patched)
    _assert_close(run_grads(model, plan.loss_sum, [batch]), reference)


@pytest.mark.parametrize("model_type", ["mamba", "mamba2"])
def test_an_lm_that_drops_position_ids_still_separates_the_documents(model_type):
    """MambaForCausalLM does not hand position_ids to its body: given the LM, the mixers take the LM's (the loss
    head's check and the self-check call the whole LM); without it they see one document."""
    model = tiny_model(model_type).eval()
    batch = packed_batch(DOCS)
    with torch.no_grad():
        alone = torch.cat([model(input_ids=doc["input_ids"], use_cache=False).logits
                           for doc in split_documents(batch, DOCS)], dim=1)
        parts = find_parts(model)
        handle = install_mixers(parts.body, parts.layers, pack=True)
        joined = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
        assert not torch.allclose(joined, alone, atol=1e-5)
        handle.undo()
        install_mixers(parts.body, parts.layers, pack=True, lm=parts.lm)
        separate = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
    torch.testing.assert_close(separate, alone, rtol=1e-4, atol=1e-5)
