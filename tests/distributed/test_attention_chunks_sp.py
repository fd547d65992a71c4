"""Chunked attention (FPDT) under Ulysses SP on 2 and 4 gloo processes: loss and every gradient equal plain HF on
the whole sequence (which is what SP 1 is proven to equal in tests/unit/memory/test_attention_chunks.py).

Each rank's shard is cut into 3 chunks; the Ulysses attention function all-to-alls each chunk, so a chunk's gathered
tokens are every rank's chunk m (not contiguous) and masks come from global token indices. Windows (16 tokens) and
packed documents cross both chunk and shard edges.
"""

from __future__ import annotations

import pytest

SEQ = 96
DOCS = [41, 30, 25]
TOL = 2e-5
ARCHS = ["llama", "mistral", "qwen2", "gemma3_text", "qwen3_moe"]


def _chunked_sp_worker(rank: int, world: int, model_types: list[str]) -> dict:
    import copy

    from lstune.config.schema import MemorySection
    from lstune.memory.apply import apply_memory_techniques
    from lstune.parallel.dims import ParallelDims
    from lstune.parallel.loss import global_mean, global_token_count, local_objective, sum_gradients
    from lstune.parallel.sp_data import count_tokens, shard_batch
    from lstune.parallel.ulysses import apply_ulysses
    from tests.support.archs import tiny_model
    from tests.unit.memory._helpers import hf_loss_sum, long_batch, packed_batch, run_grads, split_documents

    dims = ParallelDims(world, sp=world).build_groups()
    options = {
        "alone": dict(attn_chunks=3, tiled_mlp="off", tiled_loss="off", checkpointing=False),
        "all": dict(attn_chunks=3, tiled_mlp=2, tiled_loss=2, offload_checkpoints=True),
    }
    results = {}
    for model_type in model_types:
        base = tiny_model(model_type)
        for data in ("long", "packed"):
            batch = long_batch(SEQ) if data == "long" else packed_batch(DOCS)
            n = int(count_tokens(batch))
            parts = [batch] if data == "long" else split_documents(batch, DOCS)
            ref_loss, ref_grads = run_grads(base, hf_loss_sum, parts, scale=n)
            for name, memory in options.items():
                model = copy.deepcopy(base)
                apply_ulysses(model, dims)
                plan = apply_memory_techniques(model, MemorySection(**memory), seq_len=SEQ // world)
                shard = shard_batch(batch, dims.sp, dims.sp_rank)
                local_sum, _ = plan.loss_sum(model, shard)
                local_objective(local_sum, global_token_count([shard])).backward()
                sum_gradients(model.parameters())
                loss = global_mean([local_sum.detach()], [count_tokens(shard)])
                grads = {k: p.grad for k, p in model.named_parameters() if p.grad is not None}
                scale = max(float(g.abs().max()) for g in ref_grads.values())
                diff = max(
                    float((grads[k] - g).abs().max()) / max(float(g.abs().max()), 1e-3 * scale)
                    for k, g in ref_grads.items()
                )
                results[(model_type, data, name)] = (loss, ref_loss / n, diff, grads.keys() == ref_grads.keys(),
                                                     plan.attn_chunks_at_seq_len)
    return results


@pytest.mark.parametrize("world", [2, 4])
def test_chunked_attention_under_sp_matches_hf(pools, world):
    results = pools[world].run(_chunked_sp_worker, ARCHS, timeout=600)
    assert len(results[0]) == len(ARCHS) * 4
    for key, (loss, ref_loss, diff, same_keys, chunks) in results[0].items():
        assert chunks == 3 and same_keys, key
        assert loss == pytest.approx(ref_loss, rel=TOL), f"{key}: loss {loss} != {ref_loss}"
        assert diff < 1e-4, f"{key}: gradients differ by {diff:.1e} (relative)"


@pytest.mark.parametrize("memory", [
    {"attn_chunks": 3, "tiled_mlp": "off", "tiled_loss": "off", "checkpointing": False},
    {"attn_chunks": 3, "tiled_mlp": 2, "tiled_loss": 2, "checkpointing": True, "offload_checkpoints": True},
], ids=["alone", "all"])
def test_chunked_attention_under_zero3_and_sp_trains_like_one_process(pools, memory):
    """5 ZeRO-3 + SP=2 training steps with chunked attention: per-step losses and gradient norms equal a
    single-process AdamW run (weights gathered per use inside each chunk's re-runs, gradients into `.grad`)."""
    from tests.distributed.test_zero3_sp_training import _check, _train_worker

    _check(pools[2].run(_train_worker, 2, 3, "tiny-llama", memory)[0])
