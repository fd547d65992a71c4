"""Ulysses SP on 2 and 4 gloo processes gives the unsharded model's loss and every gradient.

Cases: MHA, GQA, MQA, kv replication (kv < sp), and head counts the SP degree does not divide; one long
sample per row and packed documents; sequence lengths that need padding. SP runs lstune's attention
(the default Ulysses kernel); the reference is the plain HF model (SDPA with transformers' own packed
mask) on the full batch in the same process.
"""

from __future__ import annotations

import pytest

# (name, preset, overrides) — head counts chosen to hit every partition layout on 2 and 4 ranks.
CASES = {
    "mha": ("tiny-phi3", {}),  # 4q/4kv
    "gqa": ("tiny-llama", {"hidden_size": 64}),  # 4q/2kv: kv sharded on 2, replicated on 4
    "mqa": ("tiny-gemma3", {}),  # 4q/1kv: kv replicated
    "qwen3": ("tiny-qwen3", {}),  # q/k norms, tied embeddings
    "gemma2": ("tiny-gemma2", {"attn": "eager"}),  # final logit softcap, sliding-window layer types
    "moe": ("tiny-qwen3-moe", {}),
    "uneven-mha": ("tiny-llama", {"hidden_size": 48, "num_attention_heads": 3, "num_key_value_heads": 3}),
    "uneven-gqa": ("tiny-llama", {"hidden_size": 96, "num_attention_heads": 6, "num_key_value_heads": 2}),
    "uneven-9": ("tiny-llama", {"hidden_size": 72, "head_dim": 8, "num_attention_heads": 9, "num_key_value_heads": 3}),
}
# (seq, docs): a long sample, packed documents, a length no SP degree here divides.
DATA = [(64, 1), (64, 4), (61, 3)]
TOL = 2e-5


def _equivalence_worker(rank: int, world: int, case_names: list[str], memory: bool = False) -> dict:
    import copy

    from lstune.config.schema import MemorySection
    from lstune.memory.apply import apply_memory_techniques
    from lstune.parallel.dims import ParallelDims
    from lstune.parallel.loss import global_mean, global_token_count, local_objective, sum_gradients
    from lstune.parallel.sp_data import count_tokens, shard_batch
    from lstune.parallel.ulysses import apply_ulysses
    from tests.distributed._helpers import (
        grads_of,
        loss_sum,
        make_batch,
        max_grad_diff,
        tiny_model,
    )

    dims = ParallelDims(world, sp=world).build_groups()
    results = {}
    for name in case_names:
        arch, overrides = CASES[name]
        if overrides.get("num_attention_heads", 4) < world:
            continue
        ref = tiny_model(arch, **dict(overrides))
        model = copy.deepcopy(ref)
        handle = apply_ulysses(model, dims)
        plan = None
        if memory:  # every technique, small tiles so each one really cuts the shard
            memory_section = MemorySection(tiled_mlp=2, tiled_loss=3, checkpointing=True, offload_checkpoints=True)
            plan = apply_memory_techniques(model, memory_section, seq_len=64 // world)
        for seq, docs in DATA:
            ref.zero_grad(set_to_none=True)
            model.zero_grad(set_to_none=True)
            batch = make_batch(seq, seed=seq + docs, docs=docs)
            ref_sum, ref_n = loss_sum(ref, batch)
            (ref_sum / ref_n).backward()

            shard = shard_batch(batch, dims.sp, dims.sp_rank)
            n_global = global_token_count([shard])
            local_sum = plan.loss_sum(model, shard)[0] if memory else loss_sum(model, shard)[0]
            local_objective(local_sum, n_global).backward()
            sum_gradients(model.parameters())

            loss = global_mean([local_sum.detach()], [count_tokens(shard)])
            diff, worst = max_grad_diff(grads_of(model), grads_of(ref))
            results[(name, seq, docs)] = (loss, (ref_sum / ref_n).item(), n_global, ref_n, diff, worst)
        if plan is not None:
            plan.undo()
        handle.undo()
    return results


def _check(results: list[dict]) -> None:
    for key, (loss, ref_loss, n, ref_n, diff, worst) in results[0].items():
        assert n == ref_n, f"{key}: token count {n} != {ref_n}"
        assert loss == pytest.approx(ref_loss, rel=TOL, abs=TOL), f"{key}: loss {loss} != {ref_loss}"
        assert diff < TOL, f"{key}: gradient of {worst} differs by {diff:.2e} (relative)"
    for other in results[1:]:
        for key, (_, _, _, _, diff, worst) in other.items():
            assert diff < TOL, f"rank gradient mismatch {key}: {worst} {diff:.2e}"


@pytest.mark.parametrize("world", [2, 4])
def test_sp_matches_unsharded_loss_and_gradients(pools, world):
    results = pools[world].run(_equivalence_worker, list(CASES))
    runnable = [name for name, (_, o) in CASES.items() if o.get("num_attention_heads", 4) >= world]
    assert len(results[0]) == len(runnable) * len(DATA)
    _check(results)


@pytest.mark.parametrize("world", [2, 4])
def test_sp_with_every_memory_technique_matches_unsharded(pools, world):
    """Tiled MLP, tiled loss, checkpointing with host offload, on top of Ulysses: still the same numbers."""
    results = pools[world].run(_equivalence_worker, ["gqa", "uneven-9"], True)
    assert len(results[0]) == 2 * len(DATA)
    _check(results)


def _saved_bytes_worker(rank: int, world: int) -> tuple[int, int]:
    """Activation bytes saved for backward: full sequence unsharded vs this rank's SP shard."""
    import torch

    from lstune.parallel.dims import ParallelDims
    from lstune.parallel.sp_data import shard_batch
    from lstune.parallel.ulysses import apply_ulysses
    from tests.distributed._helpers import loss_sum, make_batch, tiny_model

    def saved(model, batch) -> int:
        params = {p.data_ptr() for p in model.parameters()}
        total = 0

        def pack(t):
            nonlocal total
            if t.data_ptr() not in params:
                total += t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss_sum(model, batch)
        return total

    dims = ParallelDims(world, world).build_groups()
    batch = make_batch(256, docs=2)
    model = tiny_model("tiny-llama", hidden_size=64)
    full = saved(model, batch)
    handle = apply_ulysses(model, dims)
    mine = saved(model, shard_batch(batch, dims.sp, dims.sp_rank))
    handle.undo()
    return full, mine


@pytest.mark.parametrize("world", [2, 4])
def test_each_rank_saves_a_1_over_sp_share_of_activations(pools, world):
    """The memory Ulysses promises: what a rank keeps for backward shrinks with the SP degree."""
    for full, mine in pools[world].run(_saved_bytes_worker):
        assert 0.5 * full / world < mine <= full / world * 1.05, f"rank saved {mine} B; unsharded {full} B"
