"""Which engine trains the model: the rules of `choose_zero` on every branch, with no GPU needed."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from lstune.config.schema import ParallelSection
from lstune.errors import ConfigError
from lstune.train.engine_choice import choose_zero

GiB = 1024**3


class _Params(torch.nn.Module):
    """A stand-in model: `total` parameters (on meta, no memory), `trainable` of them trainable."""

    def __init__(self, total: int, trainable: int):
        super().__init__()
        self.frozen = torch.nn.Parameter(torch.empty(total - trainable, device="meta"), requires_grad=False)
        self.trained = torch.nn.Parameter(torch.empty(trainable, device="meta"))


def _runtime(device="cpu", world=1, mem=80 * GiB, monkeypatch=None):
    if monkeypatch is not None:
        monkeypatch.setattr("lstune.train.engine_choice._device_memory", lambda runtime: mem)
    launch = SimpleNamespace(local_world_size=world) if world > 1 else None
    return SimpleNamespace(device=torch.device(device), world_size=world, launch=launch)


def test_one_cpu_process_trains_with_plain_adamw():
    assert choose_zero(ParallelSection(), _Params(1000, 1000), _runtime()) is None


def test_one_gpu_keeps_adamw_while_the_state_fits_half_its_memory(monkeypatch):
    small = _Params(100_000_000, 100_000_000)  # 18 bytes each: 1.8 GB
    assert choose_zero(ParallelSection(), small, _runtime("cuda", mem=80 * GiB, monkeypatch=monkeypatch)) is None
    big = _Params(8_000_000_000, 8_000_000_000)  # 144 GB: ALST's single-GPU setup
    plan = choose_zero(ParallelSection(), big, _runtime("cuda", mem=80 * GiB, monkeypatch=monkeypatch))
    assert (plan.stage, plan.offload_optimizer) == (3, True)


def test_several_processes_always_use_deepspeed(monkeypatch):
    plan = choose_zero(ParallelSection(), _Params(1000, 1000), _runtime(world=4, monkeypatch=monkeypatch))
    assert plan is not None and plan.stage == 1


def test_an_explicit_stage_and_offload_are_taken_as_given(monkeypatch):
    parallel = ParallelSection(zero_stage="3", offload_optimizer=True, offload_params=True)
    plan = choose_zero(parallel, _Params(10, 10), _runtime())
    assert (plan.stage, plan.offload_optimizer, plan.offload_params, plan.reason) == (
        3, True, True, "chosen with --zero-stage")
    asked = choose_zero(ParallelSection(offload_optimizer=True), _Params(10, 10), _runtime())
    assert (asked.stage, asked.offload_optimizer, asked.reason) == (3, True, "host offload asked for")


def test_stage_zero_with_several_processes_is_refused_with_the_config_rule():
    with pytest.raises(ConfigError, match="--zero-stage 0 is plain single-device AdamW"):
        choose_zero(ParallelSection(zero_stage="0"), _Params(10, 10), _runtime(world=2))
    assert choose_zero(ParallelSection(zero_stage="0"), _Params(10, 10), _runtime()) is None
