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
