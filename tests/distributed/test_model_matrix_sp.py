"""SP=2 on gloo, on every architecture of tests/support/archs.py: exact (loss and every gradient vs plain HF with its
own attention and mask) or refused with the expected message; one long sample and packed documents; lstune's
attention alone and with every memory technique. Windows (16 tokens) are shorter than each rank's shard (32)."""

from __future__ import annotations

import pytest

from tests.support.archs import ARCHS, refusal

SEQ = 64
DOCS = [27, 21, 16]
TOL = 2e-5


def _matrix_worker(rank: int, world: int, model_types: list[str]) -> dict:
    from lstune.config.schema import MemorySection
    from lstune.memory.apply import apply_memory_techniques
    from lstune.memory.block_attention import block_attention
    from lstune.memory.loss import causal_lm_loss_sum
    from lstune.models.attention import use_lstune_attention
    from lstune.models.introspect import find_parts
    from lstune.parallel.dims import ParallelDims
    from lstune.parallel.sp_data import shard_batch
    from lstune.parallel.ulysses import SequenceExchange, apply_ulysses
    from lstune.train.mixers import install_mixers
    from tests.distributed._helpers import compare_sp_with_hf, reference_samples

    dims = ParallelDims(world, sp=world).build_groups()

    def variant(memory: bool):
        def run(model, batch, data):
            parts = find_parts(model)
            install_mixers(parts.body, parts.layers, pack=data == "packed", exchange=SequenceExchange(dims))
            use_lstune_attention(model, backend="sdpa", block_kernel=block_attention)  # as lstune train does
            apply_ulysses(model, dims)
            step = causal_lm_loss_sum
            if memory:
                techniques = MemorySection(tiled_mlp=2, tiled_loss=2, offload_checkpoints=True)
                step = apply_memory_techniques(model, techniques, seq_len=SEQ // world).loss_sum
            shard = shard_batch(batch, dims.sp, dims.sp_rank)
            return step(model, shard)[0], shard
        return run

    return compare_sp_with_hf(model_types, reference_samples(SEQ, DOCS), {False: variant(False), True: variant(True)})


def _expected(model_type: str, data: str, memory: bool) -> str | None:
    cases = ["attention", "sp"] + (["pack"] if data == "packed" else []) + (["tiled_mlp"] if memory else [])
    patterns = [refusal(model_type, case) for case in cases if refusal(model_type, case)]
    return "|".join(patterns) or None


def test_every_architecture_is_exact_or_refused_under_sp2(pools):
    import re

    results = pools[2].run(_matrix_worker, list(ARCHS), timeout=600)
    assert len(results[0]) == len(ARCHS) * 4
    for key, (outcome, detail) in results[0].items():
        expected = _expected(*key)
        if expected:
            assert outcome == "refused" and re.search(expected, detail), f"{key}: expected refusal, got {detail}"
            continue
        if outcome == "refused":  # show every unexpected refusal at once
            print(key, detail)
            continue
        assert outcome == "ran", f"{key}: refused: {detail}"
        loss, ref_loss, diff, same_keys = detail
        assert same_keys, key
        assert loss == pytest.approx(ref_loss, rel=TOL), f"{key}: loss {loss} != {ref_loss}"
        assert diff < 1e-4, f"{key}: gradients differ by {diff:.1e} (relative)"
