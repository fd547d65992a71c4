"""The default warmup never takes every step: the warmup rises from lr 0, so a run that is all warmup would not
train at all (a 1-step run most of all)."""

from __future__ import annotations

import pytest

from lstune.config.schema import OptimSection
from lstune.optim import OptimConfig


@pytest.mark.parametrize("max_steps, warmup", [(1, 0), (2, 1), (34, 2), (100, 3), (1000, 30)])
def test_default_warmup_is_3_percent_but_never_every_step(max_steps, warmup):
    assert OptimConfig.from_section(OptimSection(), max_steps).warmup_steps == warmup


def test_an_explicit_warmup_is_kept():
    assert OptimConfig.from_section(OptimSection(warmup_steps=1), 1).warmup_steps == 1


def test_a_one_step_run_steps_at_the_full_lr():
    torch = pytest.importorskip("torch")
    from lstune.optim import make_adamw, make_scheduler

    cfg = OptimConfig.from_section(OptimSection(lr=1e-3), 1)
    optimizer = make_adamw([torch.nn.Parameter(torch.zeros(2))], cfg)
    assert make_scheduler(optimizer, cfg).get_last_lr()[0] == pytest.approx(1e-3)
