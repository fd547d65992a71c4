"""LongRoPE (Phi-3) under sequence parallelism: every rank uses the factors the model uses on the whole sample (the
long ones past the original context), where each shard alone would pick the short ones on the first ranks. Equal to
plain HF on the whole sequence, and the startup self-check's probe crosses the original context, so a rank choosing
from its shard is caught."""

from __future__ import annotations

LONGROPE = dict(
    max_position_embeddings=128, original_max_position_embeddings=32,  # Phi3Config's own field wins over rope's
    rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 32,
                     "short_factor": [1.0, 1.1, 1.3, 1.7], "long_factor": [1.0, 2.0, 4.0, 8.0]},
)


def longrope_model():
    from tests.support.archs import tiny_model

    return tiny_model("phi3", **LONGROPE)


def _worker(rank: int, world: int, patched: bool) -> tuple[bool, float, float, int]:
    from types import SimpleNamespace

    import torch

    from lstune.config.schema import MemorySection, TrainConfig
    from lstune.errors import ModelError
    from lstune.parallel import rope_sp
    from lstune.parallel.dims import ParallelDims
    from lstune.train import self_check
    from lstune.train.runtime import Runtime

    original = rope_sp.whole_sample_longrope
    if not patched:  # each rank chooses from its own shard, as transformers does (the pool's process: put back)
        rope_sp.whole_sample_longrope = lambda model, group: rope_sp.RopeHandle([])
    dims = ParallelDims(world, sp=world).build_groups()
    runtime = Runtime(torch.device("cpu"), None, launch=SimpleNamespace(rank=rank, world_size=world), dims=dims)
    try:
        # Contiguous shards (no attention chunks, whose FPDT layout gives each rank pieces from both halves): the
        # first rank's positions all stay within the original context.
        config = TrainConfig(memory=MemorySection(attn_chunks="off"))
        result = self_check.run_self_check(longrope_model(), config, runtime)
    except ModelError:
        return False, float("nan"), float("nan"), 0
    finally:
        rope_sp.whole_sample_longrope = original
    return result.ok, result.loss_rel, result.grad_rel, result.tokens


def test_longrope_under_sp_matches_the_whole_sample_and_the_probe_crosses_the_original_context(pools):
    for ok, loss_rel, grad_rel, tokens in pools[2].run(_worker, True):
        assert ok and loss_rel < 1e-5 and grad_rel < 1e-4 and tokens > 32, (loss_rel, grad_rel, tokens)
    for ok, *_ in pools[2].run(_worker, False):
        assert not ok  # the check catches ranks that choose from their shard


def _compare_worker(rank: int, world: int, patched: bool) -> dict:
    from lstune.memory.loss import causal_lm_loss_sum
    from lstune.models.attention import use_lstune_attention
    from lstune.parallel.dims import ParallelDims
    from lstune.parallel.rope_sp import whole_sample_longrope
    from lstune.parallel.sp_data import shard_batch
    from lstune.parallel.ulysses import apply_ulysses
    from tests.distributed._helpers import compare_sp_with_hf, reference_samples

    dims = ParallelDims(world, sp=world).build_groups()

    def ulysses(model, batch, data):
        use_lstune_attention(model, backend="sdpa")
        apply_ulysses(model, dims)
        if patched:
            whole_sample_longrope(model, dims.sp_group)
        shard = shard_batch(batch, dims.sp, dims.sp_rank, None)
        return causal_lm_loss_sum(model, shard)[0], shard

    # 48 tokens, past the 32 original positions (each rank's 24 are not): the model uses the long factors.
    results = compare_sp_with_hf(["phi3"], reference_samples(48, [24, 24]), {"ulysses": ulysses},
                                 build=lambda model_type: longrope_model())
    return {data: value for (_, data, _), value in results.items() if data == "long"}


def test_longrope_under_sp_equals_hf_on_the_whole_sequence(pools):
    for patched, exact in ((True, True), (False, False)):
        for per_data in pools[2].run(_compare_worker, patched):
            for data, (kind, (loss, ref_loss, grad_diff, *_)) in per_data.items():
                assert kind == "ran"
                close = abs(float(loss) - float(ref_loss)) <= 1e-5 * abs(float(ref_loss)) and grad_diff < 1e-4
                assert close == exact, (patched, data, float(loss), float(ref_loss), grad_diff)
