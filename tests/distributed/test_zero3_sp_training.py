"""A 5-step ZeRO + SP training run through DeepSpeedEngine and the SP data adapter gives the same
per-step losses (and gradient norms) as a single-process run with plain torch AdamW on the same data.

ZeRO-3 on SP=2 and on SP=2 × DP=2 (which checks the DP part of the gradient scaling), ZeRO-2 on SP=4 and
ZeRO-1 on SP=2: DeepSpeed divides gradients differently per stage (see engine_ds.gradient_divisor).
The window holds 2 micro-batches, so gradient accumulation under ZeRO is exercised too.
"""

from __future__ import annotations

import pytest

from lstune.optim import OptimConfig

STEPS, ACCUM, SEQ = 5, 2, 48
OPTIM = OptimConfig(lr=3e-3, weight_decay=0.01, betas=(0.9, 0.95), eps=1e-8, warmup_steps=1, max_steps=STEPS,
                    schedule="cosine", min_lr_ratio=0.1, max_grad_norm=1.0)


def _samples(world: int) -> list[dict]:
    from tests.distributed._helpers import make_batch

    # Lengths vary and some need padding to a multiple of SP; every other sample is packed.
    return [make_batch(SEQ - (i % 3), seed=100 + i, docs=1 + i % 2) for i in range(STEPS * ACCUM * world)]


def _reference(model, samples: list[dict], per_step: int) -> list[tuple[float, float]]:
    """Single-process training on all samples: (loss, grad_norm) per step."""
    import torch

    from lstune.optim import make_scheduler
    from tests.distributed._helpers import loss_sum

    opt = torch.optim.AdamW(model.parameters(), lr=OPTIM.lr, betas=OPTIM.betas, eps=OPTIM.eps,
                            weight_decay=OPTIM.weight_decay)
    sched = make_scheduler(opt, OPTIM)
    out = []
    for step in range(STEPS):
        window = samples[step * per_step : (step + 1) * per_step]
        n = sum(int((b["shift_labels"] != -100).sum()) for b in window)
        total = 0.0
        for batch in window:
            s, _ = loss_sum(model, batch)
            (s / n).backward()
            total += s.item()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), OPTIM.max_grad_norm)
        opt.step()
        sched.step()
        opt.zero_grad()
        out.append((total / n, float(norm)))
    return out


def _train_worker(
    rank: int, world: int, sp: int, stage: int, arch: str, memory: dict | None = None, offload: tuple = (False, False),
    offload_ratio: float = 1.0, ring: int = 1,
) -> dict:
    import copy

    from lstune.parallel.dims import ParallelDims
    from lstune.parallel.engine_ds import DeepSpeedEngine, ZeroPlan
    from lstune.parallel.sp_data import SPDataAdapter
    from lstune.parallel.ulysses import apply_ulysses
    from tests.distributed._helpers import label_gpu_sub_groups, loss_sum, tiny_model, train_steps

    samples = _samples(world)
    model = tiny_model(arch)
    reference = _reference(copy.deepcopy(model), _global_order(samples, world, sp), ACCUM * world // sp)

    dims = ParallelDims(world, sp, ring=ring).build_groups()
    if ring > 1:  # Ulysses × ring, composed as lstune.train does
        from lstune.train.prepare import apply_sequence_parallelism

        handle = apply_sequence_parallelism(model, dims)
    else:
        handle = apply_ulysses(model, dims)
    compute_loss_sum, chunks, fused = loss_sum, None, False
    if memory is not None:  # lstune's loss head and memory techniques, applied before the engine
        from lstune.config.schema import MemorySection
        from lstune.memory.apply import apply_memory_techniques

        plan = apply_memory_techniques(model, MemorySection(**memory), seq_len=SEQ // sp)
        compute_loss_sum, chunks, fused = plan.loss_sum, plan.attn_chunking, plan.final_norm_fused
    zero = ZeroPlan(stage, *offload, 0, "test", offload_ratio)
    engine = DeepSpeedEngine(model, dims=dims, optim=OPTIM, zero=zero, bf16=False)
    label_gpu_sub_groups(engine, offload_ratio)
    batches = iter(SPDataAdapter(samples[rank::world], dims, chunks=chunks))
    losses = train_steps(engine, batches, STEPS, ACCUM, compute_loss_sum)
    handle.undo()
    backup = getattr(engine._ds.optimizer, "backup_optimizer", None)  # partial offload: the GPU sub-groups' AdamW
    return {"losses": losses, "reference": reference, "final_norm_fused": fused,
            "gpu_sub_groups": len(backup.state) if backup is not None else 0,
            "sub_groups": [int(t.numel()) for t in getattr(engine._ds.optimizer, "fp32_partitioned_groups_flat", [])],
            "estimated_sub_groups": _estimated_sub_groups(model.config, world) if offload_ratio < 1 else None}


def _estimated_sub_groups(config, world: int) -> list[int]:
    """The optimizer sub-groups lstune.estimate counts for one rank under partial offload."""
    from lstune.estimate.memory import ds_sub_groups
    from lstune.estimate.shapes import count_parameters
    from lstune.parallel.engine_ds import partial_sub_group_size

    counts = count_parameters(config)
    return ds_sub_groups(counts, world, partial_sub_group_size([-(-n // world) for n in counts.trainable_tensors]))


def _global_order(samples: list[dict], world: int, sp: int) -> list[dict]:
    """The samples in the order the SP × DP run sees them, step by step (order inside a step is irrelevant).

    Rank r's loader holds samples[r::world]; an SP group takes one sample from each of its ranks per
    round (rank order), and each step takes ACCUM of those per group.
    """
    per_rank = [samples[r::world] for r in range(world)]
    streams = []
    for block in range(world // sp):
        ranks = range(block * sp, (block + 1) * sp)
        streams.append([per_rank[r][k] for k in range(len(per_rank[0])) for r in ranks])
    return [b for step in range(STEPS) for stream in streams for b in stream[step * ACCUM : (step + 1) * ACCUM]]


@pytest.mark.parametrize(("world", "sp", "stage"), [(2, 2, 3), (4, 2, 3), (4, 4, 2), (2, 2, 1)])
def test_zero_sp_run_matches_single_process_losses(pools, world, sp, stage):
    _check(pools[world].run(_train_worker, sp, stage, "tiny-llama")[0])


def test_zero3_sp_with_optimizer_and_weights_on_the_host_matches_single_process(pools):
    """DeepSpeedCPUAdam on host-resident Adam state and weight shards (ALST's single-GPU setup).

    The first run on a machine compiles DeepSpeed's cpu_adam op (~1-2 min, cached afterwards).
    """
    _check(pools[2].run(_train_worker, 2, 3, "tiny-llama", None, (True, True), timeout=600)[0])


def test_zero3_sp_with_part_of_the_optimizer_on_the_host_matches_single_process(pools):
    """--offload-ratio 0.5: DeepSpeed keeps half of the optimizer sub-groups on the (here CPU) device, stepped by a
    torch AdamW, the other half in DeepSpeedCPUAdam on the host — still the single-process losses and norms; and the
    sub-groups are the ones lstune.estimate counts."""
    result = pools[2].run(_train_worker, 2, 3, "tiny-llama", None, (True, True), 0.5, timeout=600)[0]
    assert result["gpu_sub_groups"] > 0  # the device's sub-groups took their steps in the torch AdamW
    # DeepSpeed cut its sub-groups where the estimate says it does (the host and device bytes follow from the cut)
    assert len(result["sub_groups"]) > 4 and result["sub_groups"] == result["estimated_sub_groups"]
    _check(result)


@pytest.mark.parametrize("arch", ["tiny-llama", "tiny-qwen3"])
def test_zero3_sp_with_checkpoint_offload_and_loss_head_matches_single_process(pools, arch):
    """lstune's loss head (one tile) and checkpointing with host offload under ZeRO-3 + SP=2."""
    memory = {"tiled_mlp": "off", "tiled_loss": "off", "checkpointing": True, "offload_checkpoints": True}
    _check(pools[2].run(_train_worker, 2, 3, arch, memory)[0])


@pytest.mark.parametrize("chunks", ["off", 3])
def test_zero3_sp_with_attention_saved_matches_single_process(pools, chunks):
    """--recompute-attention off (lstune.memory.attention_saved) under ZeRO-3 + SP=2 with checkpoint offload, plain and
    chunked attention: each rank keeps its heads' output and lse (chunked: its chunk store) beside its checkpoints."""
    memory = {"tiled_mlp": 2, "tiled_loss": "off", "offload_checkpoints": True, "attn_chunks": chunks,
              "recompute_attention": "off"}
    _check(pools[2].run(_train_worker, 2, 3, "tiny-llama", memory)[0])


@pytest.mark.parametrize("memory", [{"tiled_mlp": 2, "tiled_loss": "off"}, {"tiled_mlp": "off", "tiled_loss": 3}])
def test_zero3_sp_with_tiled_mlp_or_loss_matches_single_process(pools, memory):
    _check(pools[2].run(_train_worker, 2, 3, "tiny-llama", {**memory, "checkpointing": False})[0])


@pytest.mark.parametrize("arch", ["tiny-llama", "tiny-gemma3"])
def test_zero3_sp_with_mini_sequence_matches_single_process(pools, arch):
    """Mini-sequence runs the fused norms inside the MLP tiles: ZeRO-3 must gather their weights there too."""
    memory = {"mini_sequence": True, "tiled_mlp": 2, "tiled_loss": "off", "checkpointing": True}
    _check(pools[2].run(_train_worker, 2, 3, arch, memory)[0])


def test_zero3_sp_with_the_final_norm_in_the_loss_tiles_matches_single_process(pools):
    """Gemma-3's final norm (1 + weight) runs in each loss tile next to its tied head: ZeRO-3 gathers it there."""
    result = pools[2].run(_train_worker, 2, 3, "tiny-gemma3", {"tiled_mlp": "off", "tiled_loss": 3})[0]
    assert result["final_norm_fused"]
    _check(result)


@pytest.mark.parametrize(("world", "sp", "ring", "memory"), [
    (4, 4, 2, {"tiled_mlp": 2, "tiled_loss": 3, "checkpointing": True, "offload_checkpoints": True}),
    (4, 2, 2, None),
])
def test_zero3_ring_run_matches_single_process(pools, world, sp, ring, memory):
    """Ulysses 2 × ring 2 with every memory technique, and ring 2 × DP 2, through ZeRO-3 and the SP adapter's zigzag
    layout: the single-process losses and gradient norms step by step."""
    _check(pools[world].run(_train_worker, sp, 3, "tiny-llama", memory, (False, False), 1.0, ring)[0])


def _check(result: dict) -> None:
    for step, ((loss, norm), (ref_loss, ref_norm)) in enumerate(zip(result["losses"], result["reference"])):
        assert loss == pytest.approx(ref_loss, rel=1e-6), f"step {step}: loss {loss} != {ref_loss}"
        assert norm == pytest.approx(ref_norm, rel=1e-5), f"step {step}: grad norm {norm} != {ref_norm}"


def _single_process_worker(rank: int, world: int) -> dict:
    """No launcher, no process group: DeepSpeedEngine creates a one-process group itself (1-GPU offload)."""
    import copy

    import torch.distributed as dist

    from lstune.parallel.dims import ParallelDims
    from lstune.parallel.engine_ds import DeepSpeedEngine, ZeroPlan
    from tests.distributed._helpers import loss_sum, tiny_model

    dist.destroy_process_group()
    samples = _samples(1)
    model = tiny_model("tiny-llama")
    reference = _reference(copy.deepcopy(model), samples, ACCUM)
    zero = ZeroPlan(3, True, False, 0, "test")
    engine = DeepSpeedEngine(model, dims=ParallelDims(1, 1), optim=OPTIM, zero=zero, bf16=False)
    losses = []
    for step in range(STEPS):
        window = samples[step * ACCUM : (step + 1) * ACCUM]
        n = sum(int((b["shift_labels"] != -100).sum()) for b in window)
        total = 0.0
        for batch in window:
            s, _ = loss_sum(engine.model, batch)
            engine.backward(s / n)
            total += s.item()
        losses.append((total / n, engine.step()["grad_norm"]))
    assert dist.is_initialized() and dist.get_world_size() == 1
    return {"losses": losses, "reference": reference}


def test_one_process_zero3_offload_without_a_launcher_matches_adamw():
    from tests.support.distributed import run_distributed

    _check(run_distributed(_single_process_worker, 1, timeout=600)[0])


def _skip_worker(rank: int, world: int, stage: int, offload: tuple) -> dict:
    """Three steps, the middle one with finite loss and non-finite gradients, through the single-device engine
    and DeepSpeed: (loss, update_skipped, lr) per step of each."""
    import copy

    import torch.distributed as dist

    from lstune.parallel.dims import ParallelDims
    from lstune.parallel.engine_ds import DeepSpeedEngine, ZeroPlan
    from lstune.train.engine import TorchEngine
    from tests.distributed._helpers import loss_sum, tiny_model

    dist.destroy_process_group()  # DeepSpeedEngine makes its own one-process group, as on one GPU
    samples = _samples(1)
    model = tiny_model("tiny-llama")
    engines = {"torch": TorchEngine(copy.deepcopy(model), OPTIM),
               "deepspeed": DeepSpeedEngine(model, dims=ParallelDims(1, 1), optim=OPTIM,
                                            zero=ZeroPlan(stage, *offload, 0, "test"), bf16=False)}
    runs = {}
    for name, engine in engines.items():
        records = []
        for step in range(3):
            batch = samples[step]
            s, _ = loss_sum(engine.model, batch)
            objective = s / int((batch["shift_labels"] != -100).sum())
            if step == 1:
                objective.register_hook(lambda grad: grad * float("inf"))
            engine.backward(objective)
            stats = engine.step()
            records.append((float(objective), stats["update_skipped"], stats["lr"]))
        runs[name] = records
    return runs


@pytest.mark.parametrize("stage, offload", [(2, (False, False)), (3, (True, True))], ids=["zero2", "zero3-offload"])
def test_deepspeed_skips_a_nonfinite_step_like_the_single_device_engine(stage, offload):
    """DeepSpeed drops a step's non-finite gradients itself; lstune reports it skipped and advances the schedule as
    the single-device engine's skip does: the step after it has the same loss (the weights were left as they were)
    and the same learning rate on both engines."""
    from tests.support.distributed import run_distributed

    runs = run_distributed(_skip_worker, 1, stage, offload, timeout=600)[0]
    for name, records in runs.items():
        assert [skipped for _, skipped, _ in records] == [False, True, False], name
    for (loss, _, lr), (ref_loss, _, ref_lr) in zip(runs["deepspeed"], runs["torch"]):
        assert loss == pytest.approx(ref_loss, rel=1e-6)
        assert lr == pytest.approx(ref_lr, rel=1e-9)
    assert runs["torch"][2][2] != runs["torch"][1][2]  # the schedule moved on through the skipped step
