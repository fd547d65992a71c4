"""The startup self-check under SP 2 with chunked attention: the shards are FPDT's pieces (and padded), and the
per-token gradients it gathers back are put in the sample's order before comparing."""

from __future__ import annotations


def _self_check_worker(rank: int, world: int, memory: dict, pack: bool) -> tuple[bool, float, float]:
    from types import SimpleNamespace

    import torch

    from lstune.config.schema import DataSection, MemorySection, TrainConfig
    from lstune.parallel.dims import ParallelDims
    from lstune.train import self_check
    from lstune.train.runtime import Runtime
    from tests.support.archs import tiny_model

    dims = ParallelDims(world, sp=world).build_groups()
    runtime = Runtime(torch.device("cpu"), None, launch=SimpleNamespace(rank=rank, world_size=world), dims=dims)
    config = TrainConfig(data=DataSection(pack=pack), memory=MemorySection(**memory))
    result = self_check.run_self_check(tiny_model("llama"), config, runtime)
    return result.ok, result.loss_rel, result.grad_rel


def test_self_check_passes_under_sp_with_chunked_attention(pools):
    for pack in (False, True):
        for ok, loss_rel, grad_rel in pools[2].run(_self_check_worker, {"attn_chunks": 5}, pack):
            assert ok and loss_rel < 1e-5 and grad_rel < 1e-4, (pack, loss_rel, grad_rel)

