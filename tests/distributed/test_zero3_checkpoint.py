"""Checkpoint/resume and HF export under ZeRO-3 + SP (2 gloo processes).

Resume: 2 steps, save, a fresh engine on a differently initialised model loads the checkpoint, 2 more
steps — the per-step losses equal those of 4 uninterrupted steps. Export: the consolidated model written
parameter by parameter reloads with from_pretrained and gives the sharded model's loss.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.distributed.test_zero3_sp_training import ACCUM, OPTIM, _samples

ARCH = "tiny-qwen3"  # tied input/output embeddings: the export must write them once and reload tied


def _steps(engine, batches, n: int) -> list[float]:
    from tests.distributed._helpers import train_steps

    return [loss for loss, _ in train_steps(engine, batches, n, ACCUM)]


def _checkpoint_worker(rank: int, world: int, tmp: str, offload_ratio: float = 1.0) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from lstune.parallel.dims import ParallelDims
    from lstune.parallel.engine_ds import DeepSpeedEngine, ZeroPlan
    from lstune.parallel.loss import global_mean
    from lstune.parallel.sp_data import SPDataAdapter, count_tokens, shard_batch
    from lstune.parallel.ulysses import apply_ulysses
    from tests.distributed._helpers import label_gpu_sub_groups, loss_sum, make_batch, tiny_model

    dims = ParallelDims(world, world).build_groups()
    mine = _samples(world)[rank::world]

    def engine_for(seed: int):
        model = tiny_model(ARCH, seed=seed)
        partial = offload_ratio < 1
        zero = ZeroPlan(3, partial, partial, 0, "test", offload_ratio)
        engine = DeepSpeedEngine(model, dims=dims, optim=OPTIM, zero=zero, bf16=False)
        label_gpu_sub_groups(engine, offload_ratio)
        return engine, apply_ulysses(model, dims)

    straight, handle = engine_for(0)
    uninterrupted = _steps(straight, iter(SPDataAdapter(mine, dims)), 4)
    straight.export(Path(tmp) / "export")
    probe = make_batch(40, seed=7, docs=2)
    shard = shard_batch(probe, dims.sp, dims.sp_rank)
    with torch.no_grad():
        sharded_loss = global_mean([loss_sum(straight.model, shard)[0]], [count_tokens(shard)])
    handle.undo()

    first, handle = engine_for(0)
    resumed = _steps(first, iter(SPDataAdapter(mine, dims)), 2)
    first.save(Path(tmp) / "ckpt")
    handle.undo()
    second, handle = engine_for(seed=123)
    second.load(Path(tmp) / "ckpt")
    batches = iter(SPDataAdapter(mine, dims))
    for _ in range(2 * ACCUM):
        next(batches)
    resumed += _steps(second, batches, 2)
    handle.undo()

    exported_loss = None
    if rank == 0:
        reloaded = AutoModelForCausalLM.from_pretrained(Path(tmp) / "export", attn_implementation="sdpa")
        with torch.no_grad():
            total, n = loss_sum(reloaded, probe)
        exported_loss = total.item() / n
    return {"uninterrupted": uninterrupted, "resumed": resumed, "sharded": sharded_loss, "exported": exported_loss}


def test_resume_and_export_under_zero3_and_sp(pools, tmp_path):
    result = pools[2].run(_checkpoint_worker, str(tmp_path))[0]
    assert result["resumed"] == pytest.approx(result["uninterrupted"], rel=1e-6)
    assert result["exported"] == pytest.approx(result["sharded"], rel=1e-6)
    files = sorted(p.name for p in (tmp_path / "export").iterdir())
    assert files == ["config.json", "generation_config.json", "model.safetensors"]


def test_resume_with_part_of_the_optimizer_on_the_gpu_equals_the_uninterrupted_run(pools, tmp_path):
    """--offload-ratio 0.5: the Adam state of the sub-groups kept on the device (DeepSpeed steps them with a torch
    AdamW whose state its checkpoint leaves out) is saved and restored by lstune, so resume stays exact."""
    result = pools[2].run(_checkpoint_worker, str(tmp_path), 0.5, timeout=600)[0]
    assert result["resumed"] == pytest.approx(result["uninterrupted"], rel=1e-6)
    assert sorted(p.name for p in (tmp_path / "ckpt" / "deepspeed").glob("gpu_optimizer_rank*.pt")) == [
        "gpu_optimizer_rank0.pt", "gpu_optimizer_rank1.pt"]
