"""gpt-oss (learned attention sinks, alternating 16-token sliding windows) under ring attention on gloo: (Ulysses,
ring) = (1, 2) on 2 processes, (2, 2) and (1, 4) on 4. The ring applies each rank's q heads' slice of the sinks once
after its merge (`attention_sinks.apply_sinks`); the 3-head model splits unevenly over 2 Ulysses ranks (2 and 1 q
heads), so each slice has its own size and start; with an 8-token window (shorter than a zigzag piece at ring 4) the
ring skips hop 2, and each row still gets its sink once. One long sample and packed documents whose boundaries cross the
zigzag pieces; alone and with the memory techniques (tiled MLP and loss, mini-sequence, offloaded checkpoints). Loss
and every gradient (the sinks' included) equal plain HF eager on the whole sequence, each packed document alone."""

from __future__ import annotations

import pytest

SEQ = 96
DOCS = [41, 30, 25]
TOL = 2e-5
LAYOUTS = {2: [(1, 2)], 4: [(2, 2), (1, 4)]}
MEMORY = dict(tiled_mlp=2, tiled_loss=2, mini_sequence=True, offload_checkpoints=True)
MODELS = {2: ["gpt_oss", "gpt_oss_3_heads"], 4: ["gpt_oss", "gpt_oss_3_heads", "gpt_oss_window_8"]}


def _build(model_type: str):
    import torch

    from tests.support.archs import tiny_model

    overrides = {"gpt_oss_3_heads": {"num_attention_heads": 3, "num_key_value_heads": 1},
                 "gpt_oss_window_8": {"sliding_window": 8}}.get(model_type, {})
    model = tiny_model("gpt_oss", **overrides)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("sinks"):
                param.copy_(torch.randn(param.shape, generator=torch.Generator().manual_seed(5)) * 2)
    return model


def _ring_sinks_worker(rank: int, world: int, layouts: list[tuple[int, int]], models: list[str]) -> dict:
    import logging
    import warnings

    from lstune.config.schema import MemorySection
    from lstune.memory.apply import apply_memory_techniques
    from lstune.memory.attention_ring import RingAttention
    from lstune.memory.block_attention import block_attention
    from lstune.memory.loss import causal_lm_loss_sum
    from lstune.models.attention import use_lstune_attention
    from lstune.parallel.dims import ParallelDims
    from lstune.parallel.sp_data import shard_batch
    from lstune.parallel.ulysses import apply_ulysses
    from tests.distributed._helpers import compare_sp_with_hf, reference_samples

    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)

    def variant(ring: int, memory: dict | None):
        dims = ParallelDims(world, sp=world, ring=ring).build_groups()

        def run(model, batch, data):
            use_lstune_attention(model, backend="sdpa", block_kernel=block_attention)  # as lstune train composes it
            apply_ulysses(model, dims, core=RingAttention.of(dims), core_name=f"ring of {ring}")
            step = causal_lm_loss_sum
            if memory is not None:
                step = apply_memory_techniques(model, MemorySection(**memory), seq_len=SEQ // world).loss_sum
            shard = shard_batch(batch, dims.sp, dims.sp_rank, ring=ring)
            return step(model, shard)[0], shard
        return run

    variants = {f"{u}x{r}": variant(r, None) for u, r in layouts}
    variants[f"{layouts[0][0]}x{layouts[0][1]}-memory"] = variant(layouts[0][1], MEMORY)
    return compare_sp_with_hf(models, reference_samples(SEQ, DOCS), variants, build=_build)


@pytest.mark.parametrize("world", [2, 4])
def test_gpt_oss_sinks_and_windows_under_ring_match_hf(pools, world):
    results = pools[world].run(_ring_sinks_worker, LAYOUTS[world], MODELS[world], timeout=600)
    assert len(results[0]) == len(MODELS[world]) * 2 * (len(LAYOUTS[world]) + 1)
    for key, (outcome, detail) in results[0].items():
        assert outcome == "ran", f"{key}: refused: {detail}"
        loss, ref_loss, diff, same_keys = detail
        assert same_keys, key
        assert loss == pytest.approx(ref_loss, rel=TOL), f"{key}: loss {loss} != {ref_loss}"
        assert diff < TOL, f"{key}: gradients differ by {diff:.1e} (relative)"
    for other in results[1:]:
        for key, (outcome, detail) in other.items():
            assert outcome == "ran" and detail[2] < TOL, (key, outcome, detail)
