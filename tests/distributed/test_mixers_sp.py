"""Linear-attention and state-space mixers under SP 2 and 4 on gloo, head-parallel (lstune.models.mixers): loss and
every gradient equal to plain HF (fp32) — the whole sequence for one long sample, each document alone for packed
ones — for Gated DeltaNet (Qwen3-Next, Qwen3.5, Qwen3.5-MoE), KDA (Kimi-Linear), Mamba-2 (Bamba, GraniteMoeHybrid,
Falcon-H1, Nemotron-H; the pure Mamba2), Mamba-1 (Jamba; the pure Mamba and FalconMamba, whose SP cap comes from their channels), ShortConv (LFM2) and lightning attention (MiniMax); with lstune's attention
alone, with the memory techniques (checkpoint recompute repeats the all-to-alls), and with LoRA. The tiny configs split 6 heads over 4 ranks unevenly (2, 2, 1, 1), two Mamba-2 groups
across ranks; each rank's shard (16 tokens at SP 4) is shorter than the documents and longer than the convolution."""

from __future__ import annotations

import pytest

from tests.support.archs import MIXER_ARCHS

SEQ = 64
DOCS = [27, 21, 16]
TOL = 2e-5
LORA_R = 4


def _with_lora(model):
    from peft import LoraConfig, get_peft_model

    import torch

    torch.manual_seed(1)
    config = LoraConfig(r=LORA_R, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0, init_lora_weights=False)
    return get_peft_model(model, config)


def _mixers_worker(rank: int, world: int, model_types: list[str], lora: bool) -> dict:
    import logging

    from lstune.config.schema import MemorySection
    from lstune.memory.apply import apply_memory_techniques
    from lstune.memory.loss import causal_lm_loss_sum
    from lstune.models.attention import use_lstune_attention
    from lstune.models.introspect import find_parts
    from lstune.parallel.dims import ParallelDims
    from lstune.parallel.sp_data import shard_batch
    from lstune.parallel.ulysses import SequenceExchange, apply_ulysses
    from lstune.train.mixers import install_mixers
    from tests.distributed._helpers import compare_sp_with_hf, reference_samples
    from tests.support.archs import tiny_model

    logging.disable(logging.WARNING)
    dims = ParallelDims(world, sp=world).build_groups()

    def variant(memory: bool):
        def run(model, batch, data):
            parts = find_parts(model)
            install_mixers(parts.body, parts.layers, pack=data == "packed", exchange=SequenceExchange(dims),
                           lm=parts.lm)
            use_lstune_attention(model, backend="sdpa")
            apply_ulysses(model, dims)
            step = causal_lm_loss_sum
            if memory:
                techniques = MemorySection(tiled_mlp="off", tiled_loss=2, offload_checkpoints=True)
                step = apply_memory_techniques(model, techniques, seq_len=SEQ // world, parts=parts).loss_sum
            shard = shard_batch(batch, dims.sp, dims.sp_rank)
            return step(model, shard)[0], shard
        return run

    def build(model_type):
        model = tiny_model(model_type, attn="eager")
        return _with_lora(model) if lora else model

    variants = {"lora": variant(False)} if lora else {"attention": variant(False), "memory": variant(True)}
    return compare_sp_with_hf(model_types, reference_samples(SEQ, DOCS), variants, build=build)


def _assert_exact(results: dict) -> None:
    failures = []
    for key, (outcome, detail) in results.items():
        expected = MIXER_ARCHS[key[0]][1].get("sp")
        if expected:
            if outcome != "refused" or expected not in detail:
                failures.append(f"{key}: expected the refusal {expected!r}, got {outcome}: {detail}")
            continue
        if outcome != "ran":
            failures.append(f"{key}: refused: {detail}")
            continue
        loss, ref_loss, diff, same_keys, *_ = detail
        if not same_keys or loss != pytest.approx(ref_loss, rel=TOL) or diff >= 1e-4:
            failures.append(f"{key}: loss {loss} vs {ref_loss}, gradients {diff:.1e}, same parameters {same_keys}")
    assert not failures, "\n".join(failures)


# At SP 4 the pure state-space models cost ~12 s each (transformers' torch scans, per document): mamba stays for its
# uneven channel split (8, 8, 7, 7); FalconMamba's norms and Mamba2's SP cap are covered at SP 2.
SP2_ONLY = {"falcon_mamba", "mamba2"}


@pytest.mark.parametrize("world", [2, 4])
def test_mixers_are_exact_under_sp(pools, world):
    types = [t for t in MIXER_ARCHS if world == 2 or t not in SP2_ONLY]
    results = pools[world].run(_mixers_worker, types, False, timeout=600)[0]
    assert len(results) == len(types) * 2 * 2
    _assert_exact(results)


def test_mixers_with_lora_are_exact_under_sp2(pools):
    # peft refuses LoRA on some Mamba models' out_proj
    types = ["qwen3_next", "qwen3_5_text", "bamba", "lfm2", "kimi_linear", "minimax"]
    results = pools[2].run(_mixers_worker, types, True, timeout=600)[0]
    assert len(results) == len(types) * 2
    _assert_exact(results)


# The layouts attention imposes on the shards (lstune.models.chunk_layout), which the mixers put back in time order on
# each head's gathered timeline: FPDT's pieces (chunked attention, 2 chunks per rank at SP 2: pieces of 16 tokens
# interleaved over the ranks) and Ulysses × ring's zigzag ((1, 2) at SP 2, (2, 2) at SP 4: 4 pieces of 16, ring
# position r holding pieces r and 3 − r); a Gated DeltaNet, a Mamba-2 and a Mamba-1 model (its x_proj summed over the
# whole SP group), long and packed.
CHUNKED = dict(attn_chunks=2, tiled_mlp="off", tiled_loss="off", checkpointing=False)
LAYOUTS = {2: {"chunks-2": (1, CHUNKED), "ring-1x2": (2, None)}, 4: {"ring-2x2": (2, None)}}
LAYOUT_TYPES = ["qwen3_next", "bamba", "jamba"]


def _layouts_worker(rank: int, world: int, model_types: list[str]) -> dict:
    import logging
    import warnings

    from tests.distributed._helpers import compare_sp_with_hf, lstune_sp_variant, reference_samples
    from tests.support.archs import tiny_model

    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    variants = {name: lstune_sp_variant(world, SEQ, ring=ring, memory=memory)
                for name, (ring, memory) in LAYOUTS[world].items()}
    return compare_sp_with_hf(model_types, reference_samples(SEQ, DOCS), variants,
                              build=lambda model_type: tiny_model(model_type, attn="eager"))


@pytest.mark.parametrize("world", [2, 4])
def test_mixers_are_exact_under_fpdt_and_ring_layouts(pools, world):
    results = pools[world].run(_layouts_worker, LAYOUT_TYPES, timeout=600)[0]
    assert len(results) == len(LAYOUT_TYPES) * 2 * len(LAYOUTS[world])
    _assert_exact(results)
    chunked = [detail[-1] for (_, _, name), (_, detail) in results.items() if name.startswith("chunks")]
    assert all(count == 2 for count in chunked), chunked  # the FPDT layout really ran (lstune_sp_variant's extra)


def _broken_view_worker(rank: int, world: int) -> str:
    """A view that reads the wrong heads' channels: the probe at install time refuses it, naming the module."""
    from lstune.errors import ModelError
    from lstune.models import mixers
    from lstune.models.introspect import find_parts
    from lstune.parallel.dims import ParallelDims
    from lstune.parallel.ulysses import SequenceExchange
    from lstune.train.mixers import install_mixers
    from tests.support.archs import tiny_model

    dims = ParallelDims(world, sp=world).build_groups()
    model = tiny_model("qwen3_next")
    family = mixers.GATED_DELTANET_FUSED
    original = family.view
    family.view = lambda module, start, count, like: original(module, 0, count, like)
    try:
        parts = find_parts(model)
        install_mixers(parts.body, parts.layers, pack=False, exchange=SequenceExchange(dims))
    except ModelError as error:
        return str(error)
    finally:
        family.view = original
    return "installed"


def test_a_wrong_head_split_is_refused_by_the_probe(pools):
    messages = pools[2].run(_broken_view_worker, timeout=300)
    assert all("layers.0.linear_attn" in m and "differs from its own forward" in m for m in messages), messages


def _zero3_worker(rank: int, world: int, model_type: str) -> dict:
    """5 steps of ZeRO-3 + SP over a model with head-parallel mixers (their views read parameters DeepSpeed
    partitions: the conv weights, A_log, dt_bias) against single-process AdamW on the same samples."""
    import copy

    from lstune.parallel.dims import ParallelDims
    from lstune.parallel.engine_ds import DeepSpeedEngine, ZeroPlan
    from lstune.parallel.sp_data import SPDataAdapter
    from lstune.parallel.ulysses import SequenceExchange, apply_ulysses
    from lstune.models.attention import use_lstune_attention
    from lstune.models.introspect import find_parts
    from lstune.train.mixers import install_mixers
    from tests.distributed import test_zero3_sp_training as zero
    from tests.distributed._helpers import loss_sum, train_steps
    from tests.support.archs import tiny_model

    from tests.distributed._helpers import make_batch

    # One document per sample: the single-process reference is plain HF on each row (packing is checked above).
    samples = [make_batch(zero.SEQ - (i % 3), seed=100 + i) for i in range(zero.STEPS * zero.ACCUM * world)]
    model = tiny_model(model_type, attn="eager")
    reference = zero._reference(copy.deepcopy(model), zero._global_order(samples, world, world),
                                zero.ACCUM * world // world)
    dims = ParallelDims(world, world).build_groups()
    parts = find_parts(model)
    install_mixers(parts.body, parts.layers, pack=True, exchange=SequenceExchange(dims))
    use_lstune_attention(model, backend="sdpa")
    apply_ulysses(model, dims)
    engine = DeepSpeedEngine(model, dims=dims, optim=zero.OPTIM, zero=ZeroPlan(3, False, False, 0, "test", 1.0),
                             bf16=False)
    batches = iter(SPDataAdapter(samples[rank::world], dims))
    return {"losses": train_steps(engine, batches, zero.STEPS, zero.ACCUM, loss_sum), "reference": reference}


@pytest.mark.parametrize("model_type", ["qwen3_next", "bamba", "jamba"])
def test_zero3_training_with_head_parallel_mixers_matches_single_process(pools, model_type):
    from tests.distributed import test_zero3_sp_training as zero

    zero._check(pools[2].run(_zero3_worker, model_type, timeout=600)[0])
