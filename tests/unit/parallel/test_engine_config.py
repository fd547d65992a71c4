"""DeepSpeed engine configuration: the config lstune runs, and refused combinations (the automatic stage is the
estimate's: tests/unit/train/test_engine_choice.py)."""

from __future__ import annotations

import pytest

from lstune.errors import ConfigError
from lstune.parallel.dims import ParallelDims
from lstune.parallel.engine_ds import deepspeed_config, gradient_divisor

GiB = 1024**3


def test_config_lets_the_loop_own_accumulation():
    cfg = deepspeed_config(zero_stage=3, offload_optimizer=True, offload_params=True, bf16=True,
                           max_grad_norm=1.0, pin_memory=False)
    assert cfg["gradient_accumulation_steps"] == 1 and cfg["managed_gradient_accumulation"] is False
    assert cfg["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert cfg["zero_optimization"]["reduce_scatter"] is True
    assert cfg["bf16"] == {"enabled": True} and cfg["gradient_clipping"] == 1.0


@pytest.mark.parametrize(
    ("stage", "offload_params", "match"), [(0, False, "--zero-stage 0"), (2, True, "--offload-params needs")]
)
def test_impossible_combinations_are_config_errors(stage, offload_params, match):
    with pytest.raises(ConfigError, match=match):
        deepspeed_config(zero_stage=stage, offload_optimizer=False, offload_params=offload_params, bf16=False,
                         max_grad_norm=1.0, pin_memory=False)


def test_gradient_divisor_follows_deepspeed_per_stage():
    dims = ParallelDims(8, 4)
    assert gradient_divisor(3, dims) == 8 and gradient_divisor(2, dims) == 2 and gradient_divisor(1, dims) == 2


def test_deepspeeds_comm_backend_starts_without_compiling_its_inference_shm_op():
    """The op is compiled when the backend starts on CPU and used only by inference_all_reduce; lstune's engine
    starts the backend without it, and leaves DeepSpeed as it found it."""
    import importlib

    ds_torch = importlib.import_module("deepspeed.comm.torch")

    from lstune.parallel.engine_ds import without_inference_shm_op

    original = ds_torch.build_shm_op
    built = []
    ds_torch.build_shm_op = lambda: built.append(1) or "compiled"
    try:
        with without_inference_shm_op():
            assert ds_torch.build_shm_op() is None
        assert not built
        assert ds_torch.build_shm_op() == "compiled" and built == [1]
    finally:
        ds_torch.build_shm_op = original


def test_partial_offload_keeps_part_of_the_optimizer_on_the_gpu_in_fine_sub_groups():
    """--offload-ratio: DeepSpeed's `ratio` of the optimizer sub-groups on the host, which lstune cuts into about
    PARTIAL_SUB_GROUPS per rank so the ratio holds to ~1/32 (DeepSpeed's default sub-group is 1e9 parameters), each
    within the power of two its pinned fp32 gradient buffer takes (a tensor below the share's power of two)."""
    from lstune.estimate.memory import ds_sub_groups
    from lstune.estimate.shapes import count_parameters
    from lstune.models.presets import preset_config
    from lstune.parallel.engine_ds import partial_sub_group_size

    counts = count_parameters(preset_config("llama-3.1-8b"))
    size = partial_sub_group_size(counts.trainable_tensors)
    assert size == 2**28 - 4096 * 14336  # the share (250,945,664) rounds up to 2^28; less one MLP matrix
    groups = ds_sub_groups(counts, 1, size)
    # the embedding one of its own, the head (as large) in the last; every other within 2^28 (1 GiB of fp32)
    assert len(groups) == 34 and groups[0] == 525_336_576 and groups[-1] > 525_336_576
    assert all(n <= 2**28 for n in groups[1:-1])
    assert partial_sub_group_size([10, 10]) == 1  # a share of 1: its own power of two, nothing below it
    cfg = deepspeed_config(zero_stage=3, offload_optimizer=True, offload_params=True, bf16=True, max_grad_norm=1.0,
                           pin_memory=True, offload_ratio=0.5, sub_group_size=size)
    zero = cfg["zero_optimization"]
    assert zero["offload_optimizer"]["ratio"] == 0.5 and zero["sub_group_size"] == size
    full = deepspeed_config(zero_stage=3, offload_optimizer=True, offload_params=True, bf16=True, max_grad_norm=1.0,
                            pin_memory=True, sub_group_size=size)["zero_optimization"]
    assert "ratio" not in full["offload_optimizer"] and "sub_group_size" not in full  # all on the host: as before


@pytest.mark.parametrize(("stage", "offload_optimizer"), [(2, True), (3, False)])
def test_a_ratio_without_stage_3_optimizer_offload_is_a_config_error(stage, offload_optimizer):
    with pytest.raises(ConfigError, match="--offload-ratio 0.5 .* needs --zero-stage 3 --offload-optimizer"):
        deepspeed_config(zero_stage=stage, offload_optimizer=offload_optimizer, offload_params=False, bf16=False,
                         max_grad_norm=1.0, pin_memory=False, offload_ratio=0.5)


def test_a_checkpoint_of_another_offload_ratio_is_refused_not_half_loaded(tmp_path):
    """DeepSpeed would fail to load, or load the host part of the optimizer state and restart the GPU part's
    silently: a checkpoint written with another --offload-ratio (or sub-groups) stops with a CheckpointError."""
    from types import SimpleNamespace

    import torch

    from lstune.errors import CheckpointError
    from lstune.parallel.engine_ds import _gpu_optimizer_states, _load_gpu_optimizer_states

    def optimizer(groups, ratio=0.5, backup=True):
        return SimpleNamespace(backup_optimizer=torch.optim.AdamW([groups[0]]) if backup else None,
                               fp32_partitioned_groups_flat=groups, partial_offload=ratio)

    groups = [torch.zeros(6), torch.zeros(4)]
    writer = optimizer(groups)
    writer.backup_optimizer.state[groups[0]] = {"step": torch.tensor(3.0), "exp_avg": torch.ones(6),
                                                "exp_avg_sq": torch.ones(6)}
    path = tmp_path / "deepspeed" / "gpu_optimizer_rank0.pt"
    path.parent.mkdir()
    torch.save(_gpu_optimizer_states(writer), path)

    reader = optimizer(groups)
    _load_gpu_optimizer_states(reader, path)
    state = reader.backup_optimizer.state[groups[0]]
    assert torch.equal(state["exp_avg"], torch.ones(6)) and state["step"] == 3
    with pytest.raises(CheckpointError, match="written with --offload-ratio below 1"):
        _load_gpu_optimizer_states(optimizer(groups, 1.0, backup=False), path)
    with pytest.raises(CheckpointError, match=r"--offload-ratio 0.5, 2 sub-groups\) does not match"):
        _load_gpu_optimizer_states(optimizer(groups, 0.25), path)
    with pytest.raises(CheckpointError, match="does not match"):
        _load_gpu_optimizer_states(optimizer([torch.zeros(5), torch.zeros(5)]), path)
    with pytest.raises(CheckpointError, match=r"written with --offload-ratio 1 \(or none\)"):
        _load_gpu_optimizer_states(optimizer(groups), path.with_name("gpu_optimizer_rank1.pt"))
