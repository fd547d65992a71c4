"""Chunked attention (FPDT) under Ulysses SP on 2 and 4 gloo processes: loss and every gradient equal plain HF on
the whole sequence (which is what SP 1 is proven to equal in tests/unit/memory/test_attention_chunks.py).

Each rank's shard is cut into 3 chunks and laid out in FPDT's order (shard_batch given the plan's chunk setting):
rank r holds pieces r, r+sp, r+2·sp of 3·sp, so the all-to-all of every rank's chunk m is one contiguous stretch of
the sample. Windows (16 tokens) and packed documents cross chunk, piece and shard edges; the odd-length sample is
padded (to a multiple of 3·sp) with tokens that must change nothing. A batch in contiguous shards is refused. The
setup probes (norms fused into the chunks, mini-sequence) run under SP too.
"""

from __future__ import annotations

import pytest

SEQ = 96
DOCS = [41, 30, 25]
ODD = SEQ - 5  # padded to 96 on 2 and 4 ranks
TOL = 2e-5
ARCHS = ["llama", "mistral", "qwen2", "gemma3_text", "qwen3_moe"]
OPTIONS = {
    "alone": dict(attn_chunks=3, tiled_mlp="off", tiled_loss="off", checkpointing=False),
    "all": dict(attn_chunks=3, tiled_mlp=2, tiled_loss=2, mini_sequence=True, offload_checkpoints=True),
}


def _chunked_sp_worker(rank: int, world: int, model_types: list[str]) -> dict:
    from lstune.config.schema import MemorySection
    from lstune.memory.apply import apply_memory_techniques
    from lstune.parallel.dims import ParallelDims
    from lstune.parallel.sp_data import shard_batch
    from lstune.parallel.ulysses import apply_ulysses
    from tests.distributed._helpers import compare_sp_with_hf, reference_samples
    from tests.unit.memory._helpers import long_batch

    dims = ParallelDims(world, sp=world).build_groups()

    def variant(memory: dict, *, fpdt_order: bool = True):
        def run(model, batch, data):
            apply_ulysses(model, dims)
            plan = apply_memory_techniques(model, MemorySection(**memory), seq_len=SEQ // world)
            shard = shard_batch(batch, dims.sp, dims.sp_rank, plan.attn_chunking if fpdt_order else None)
            local = shard["input_ids"].shape[1]
            return plan.loss_sum(model, shard)[0], shard, plan.attn_chunks_at_seq_len, local, plan.attn_fused_norms
        return run

    samples = reference_samples(SEQ, DOCS)
    odd = long_batch(ODD)
    samples["odd"] = (odd, [odd])
    variants = {name: variant(memory) for name, memory in OPTIONS.items()}
    variants["contiguous"] = variant(OPTIONS["alone"], fpdt_order=False)
    return compare_sp_with_hf(model_types, samples, variants)


@pytest.mark.parametrize("world", [2, 4])
def test_chunked_attention_under_sp_matches_hf(pools, world):
    results = pools[world].run(_chunked_sp_worker, ARCHS, timeout=600)
    assert len(results[0]) == len(ARCHS) * 3 * 3
    for (arch, data, name), (outcome, detail) in results[0].items():
        if name == "contiguous":
            # The shards' gathered chunks jump mid-document (long, packed) or do not cut into equal chunks (odd).
            assert outcome == "refused" and "FPDT" in detail, f"{arch} {data}: contiguous shards ran: {detail}"
            continue
        assert outcome == "ran", f"{arch} {data} {name}: {detail}"
        loss, ref_loss, diff, same_keys, chunks, local, fused = detail
        assert chunks == 3 and same_keys and local == SEQ // world, (arch, data, name)
        assert fused, f"{arch}: the setup probes under SP left the attention norms unfused"
        assert loss == pytest.approx(ref_loss, rel=TOL), f"{arch} {data} {name}: loss {loss} != {ref_loss}"
        assert diff < 1e-4, f"{arch} {data} {name}: gradients differ by {diff:.1e} (relative)"


def _module_runs_worker(rank: int, world: int) -> tuple[int, int]:
    """Runs of layer 0's attention module (its q projection) in one forward + backward of a 3-chunk shard under
    SP, and of the same chunking on one process (every rank runs that too)."""
    import copy

    from lstune.config.schema import MemorySection
    from lstune.memory.apply import apply_memory_techniques
    from lstune.models.attention import use_lstune_attention
    from lstune.parallel.dims import ParallelDims
    from lstune.parallel.sp_data import shard_batch
    from lstune.parallel.ulysses import apply_ulysses
    from tests.support.archs import tiny_model
    from tests.unit.memory._helpers import long_batch

    dims = ParallelDims(world, sp=world).build_groups()
    base, memory = tiny_model("llama"), MemorySection(**OPTIONS["alone"])
    batch = long_batch(SEQ)
    counts = []
    for sp in (world, 1):
        model, runs = copy.deepcopy(base), []
        apply_ulysses(model, dims) if sp > 1 else use_lstune_attention(model)
        plan = apply_memory_techniques(model, memory, seq_len=SEQ // sp)
        model.model.layers[0].self_attn.q_proj.register_forward_hook(lambda *_: runs.append(1))
        shard = shard_batch(batch, sp, dims.sp_rank if sp > 1 else 0, plan.attn_chunking)
        plan.loss_sum(model, shard)[0].backward()
        counts.append(len(runs))
    return tuple(counts)


def test_sp_runs_the_attention_module_as_often_as_one_process(pools):
    """FPDT's layout keeps gathered chunks causal: per chunk one forward run, one replay and one backward re-run
    (3 × 3 chunks), under SP as without it — no pass that only stores k/v first."""
    for sp_runs, single_runs in pools[2].run(_module_runs_worker):
        assert (sp_runs, single_runs) == (9, 9)


@pytest.mark.parametrize("memory", [
    {"attn_chunks": 3, "tiled_mlp": "off", "tiled_loss": "off", "checkpointing": False},
    {"attn_chunks": 3, "tiled_mlp": 2, "tiled_loss": 2, "checkpointing": True, "offload_checkpoints": True},
], ids=["alone", "all"])
def test_chunked_attention_under_zero3_and_sp_trains_like_one_process(pools, memory):
    """5 ZeRO-3 + SP=2 training steps with chunked attention: per-step losses and gradient norms equal a
    single-process AdamW run (weights gathered per use inside each chunk's re-runs, gradients into `.grad`)."""
    from tests.distributed.test_zero3_sp_training import _check, _train_worker

    _check(pools[2].run(_train_worker, 2, 3, "tiny-llama", memory)[0])


# Chunked attention under Ulysses × ring (chunk-major zigzag layout: inside each chunk, ring position r holds pieces r
# and 2R−1−r; each chunk's K/V all-gathered over the ring, its gradients reduce-scattered home). 2 chunks; Llama
# (GQA 4q/2kv) and gpt-oss (GQA, learned sinks, 16-token windows on alternating layers); one long sample and packed
# documents [41, 30, 25] crossing chunk, piece and shard edges; alone and with every memory technique (tiled MLP and
# loss, mini-sequence, checkpoints and chunks offloaded to the host).
RING_LAYOUTS = {2: [(1, 2)], 4: [(2, 2), (1, 4)]}
RING_MODELS = {2: ["llama", "gpt_oss"], 4: ["gpt_oss"]}
RING_MEMORY = {
    "alone": dict(attn_chunks=2, tiled_mlp="off", tiled_loss="off", checkpointing=False),
    "all": dict(attn_chunks=2, tiled_mlp=2, tiled_loss=2, mini_sequence=True, offload_checkpoints=True),
}


def _ring_build(model_type: str):
    from tests.distributed.test_ring_sinks_sp import _build

    return _build(model_type)


def _chunked_ring_worker(rank: int, world: int, layouts: list[tuple[int, int]], models: list[str]) -> dict:
    import logging
    import warnings

    from tests.distributed._helpers import compare_sp_with_hf, lstune_sp_variant, reference_samples

    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    variants = {f"{u}x{r}-{name}": lstune_sp_variant(world, SEQ, ring=r, memory=memory)
                for u, r in layouts for name, memory in RING_MEMORY.items()}
    return compare_sp_with_hf(models, reference_samples(SEQ, DOCS), variants, build=_ring_build)


@pytest.mark.parametrize("world", [2, 4])
def test_chunked_attention_under_ring_matches_hf(pools, world):
    from tests.distributed._helpers import assert_sp_matches_hf

    results = pools[world].run(_chunked_ring_worker, RING_LAYOUTS[world], RING_MODELS[world], timeout=600)
    count = len(RING_MODELS[world]) * 2 * len(RING_LAYOUTS[world]) * len(RING_MEMORY)
    assert_sp_matches_hf(results[0], count, loss_tol=TOL, grad_tol=TOL)
    for other in results:
        for key, (outcome, detail) in other.items():
            assert outcome == "ran" and detail[2] < TOL and detail[4] == 2, (key, outcome, detail)
