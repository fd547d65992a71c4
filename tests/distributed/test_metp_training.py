"""`--metp-mlp` through DeepSpeedEngine: METP's MLP shards trained beside ZeRO (lstune.parallel.local_params) give the
single-process run's losses and gradient norms step by step (5 steps of 2 micro-batches, clipping at 1.0 active),
and the exported model (loaded with transformers: the full MLP weights gathered from the shards, and every other
weight) equals the single-process run's.

ZeRO-1 on SP 2, ZeRO-2 on SP 2 × DP 2 (the shards' gradients summed over their DP replicas only), ZeRO-3 on Ulysses 2
× ring 2 (the shards never partitioned), ZeRO-2 with the optimizer on the host, ZeRO-3 with the optimizer and the
weights on the host (--offload-params: the shards stay on the device); and a resume under the same layout equals the
uninterrupted run.
"""

from __future__ import annotations

import pytest

from tests.distributed.test_zero3_sp_training import ACCUM, OPTIM, SEQ, STEPS, _check, _global_order, _samples


def _reference(model, samples: list[dict], per_step: int) -> list[tuple[float, float]]:
    from tests.distributed.test_zero3_sp_training import _reference as losses

    return losses(model, samples, per_step)


def _metp_train_worker(rank: int, world: int, sp: int, stage: int, ring: int, out: str,
                       resume_at: int | None = None, offload: bool = False, memory: dict | None = None,
                       offload_params: bool = False) -> dict:
    import copy
    from pathlib import Path

    from lstune.memory.metp_mlp import install_metp_mlp
    from lstune.memory.rotation import Ring
    from lstune.models.introspect import find_parts
    from lstune.parallel.dims import ParallelDims
    from lstune.parallel.engine_ds import DeepSpeedEngine, ZeroPlan
    from lstune.parallel.local_params import LocalParams
    from lstune.parallel.sp_data import SPDataAdapter
    from lstune.train.prepare import apply_sequence_parallelism
    from tests.distributed._helpers import loss_sum, tiny_model, train_steps

    samples = _samples(world)
    base = tiny_model("tiny-llama")
    reference_model = copy.deepcopy(base)
    reference = _reference(reference_model, _global_order(samples, world, sp), ACCUM * world // sp)
    dims = ParallelDims(world, sp, ring=ring).build_groups()

    plans = []

    def build():
        model = copy.deepcopy(base)
        handle = apply_sequence_parallelism(model, dims)
        if memory is not None:  # lstune's memory techniques before METP, as lstune.train.prepare applies them
            from lstune.config.schema import MemorySection
            from lstune.memory.apply import apply_memory_techniques

            plans.append(apply_memory_techniques(model, MemorySection(**memory), seq_len=SEQ // sp))
        metp = install_metp_mlp(find_parts(model).layers,
                                Ring(dims.sp, dims.sp_rank, tuple(dims.sp_group_ranks(dims.dp_rank)), dims.sp_group))
        local = LocalParams(metp.shard_parameters(), dims, OPTIM, full_weights=metp.full_weights)
        engine = DeepSpeedEngine(model, dims=dims, optim=OPTIM, zero=ZeroPlan(stage, offload, offload_params, 0, "test"),
                                 bf16=False, local=local)
        return model, handle, metp, engine

    model, handle, metp, engine = build()
    compute, chunks = (plans[0].loss_sum, plans[0].attn_chunking) if plans else (loss_sum, None)
    batches = iter(SPDataAdapter(samples[rank::world], dims, chunks=chunks))
    if resume_at is None:
        losses = train_steps(engine, batches, STEPS, ACCUM, compute)
    else:  # train, save, build afresh, load, train on: the uninterrupted run's numbers
        losses = train_steps(engine, batches, resume_at, ACCUM, loss_sum)
        engine.save(Path(out) / "ckpt")
        handle.undo()
        metp.undo()
        model, handle, metp, engine = build()
        engine.load(Path(out) / "ckpt")
        losses += train_steps(engine, batches, STEPS - resume_at, ACCUM, loss_sum)
    registered = {n for n, _ in model.named_parameters()}
    engine.export(Path(out) / "final")  # every rank takes part; rank 0 writes
    diffs, names = {}, set()
    if rank == 0:  # the exported model, loaded with transformers, against the one-process run's weights
        from transformers import AutoModelForCausalLM

        exported = dict(AutoModelForCausalLM.from_pretrained(Path(out) / "final").named_parameters())
        ref = {n: p.detach() for n, p in reference_model.named_parameters()}
        names = set(exported)
        diffs = {n: float((exported[n].detach() - ref[n]).abs().max() / ref[n].abs().max()) for n in ref}
    metp.undo()
    for memory_plan in plans[-1:]:
        memory_plan.undo()
    handle.undo()
    return {"losses": losses, "reference": reference, "weight_diffs": diffs,
            "weights_seen": names == {n for n, _ in reference_model.named_parameters()},
            "mlp_registered": any(".mlp." in n for n in registered)}


@pytest.mark.parametrize(("world", "sp", "stage", "ring"), [(2, 2, 1, 1), (4, 2, 2, 1), (4, 4, 3, 2)])
def test_metp_zero_run_matches_single_process(pools, tmp_path, world, sp, stage, ring):
    result = pools[world].run(_metp_train_worker, sp, stage, ring, str(tmp_path), timeout=600)[0]
    _check(result)
    assert not result["mlp_registered"]  # DeepSpeed never saw the shards
    assert result["weights_seen"]  # the exported folder holds every weight, the full MLP ones included
    _check_weights(result["weight_diffs"])


@pytest.mark.parametrize(("stage", "offload_params"), [(2, False), (3, True)], ids=["zero2", "zero3-params-too"])
def test_metp_with_the_optimizer_offloaded_matches_single_process(pools, tmp_path, stage, offload_params):
    """ZeRO-2 with DeepSpeedCPUAdam on the host (its norm then comes from the offload path), and ZeRO-3 with its
    weights on the host as well (--offload-params): the shards, outside DeepSpeed and stepped by their own AdamW on the
    device, still give the one-process numbers."""
    result = pools[2].run(_metp_train_worker, 2, stage, 1, str(tmp_path), None, True, None, offload_params,
                          timeout=600)[0]
    _check(result)
    _check_weights(result["weight_diffs"])


def test_metp_with_chunked_attention_and_checkpointing_matches_single_process(pools, tmp_path):
    """What `auto` may pick beside METP under Ulysses: attention in 2 chunks (FPDT's token layout), checkpointing, the
    tiled loss head — METP's MLP works per token, in whatever layout the tokens come."""
    memory = {"tiled_mlp": "off", "tiled_loss": 2, "checkpointing": True, "attn_chunks": 2}
    result = pools[2].run(_metp_train_worker, 2, 1, 1, str(tmp_path), None, False, memory, timeout=600)[0]
    _check(result)
    _check_weights(result["weight_diffs"])


def test_metp_zero_resume_matches_uninterrupted_run(pools, tmp_path):
    result = pools[2].run(_metp_train_worker, 2, 2, 1, str(tmp_path), 2, timeout=600)[0]
    _check(result)
    _check_weights(result["weight_diffs"])


def _check_weights(diffs: dict[str, float]) -> None:
    """Trained weights against the single-process run's, relative to each tensor's largest entry. The embedding's rows
    with tiny gradients amplify summation-order noise through Adam's 1/sqrt(v) (plain ZeRO + SP, without METP, differs
    by ~1e-4 there too); an MLP shard trained wrong (unclipped, unreduced over DP, a step missed) differs by ~1e-2."""
    assert diffs and any(".mlp." in name for name in diffs)
    for name, diff in diffs.items():
        assert diff < (1e-4 if ".mlp." in name else 2e-3), (name, diff)
