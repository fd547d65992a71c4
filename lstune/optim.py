"""The optimizer settings of a run and the learning-rate schedule, shared by both engines.

`OptimConfig` is the one description of AdamW and its schedule that `TorchEngine` (one device) and
`DeepSpeedEngine` (ZeRO) take; neither has defaults of its own. `OptimConfig.from_section` resolves the
config's optim section for a run of `max_steps` steps (default warmup: 3% of them, never all).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from lstune.config.schema import OptimSection
from lstune.errors import ConfigError

SCHEDULES = {"cosine": "cosine_with_min_lr", "linear": "linear", "constant": "constant_with_warmup"}
DEFAULT_WARMUP_SHARE = 0.03


@dataclass(frozen=True)
class OptimConfig:
    lr: float
    weight_decay: float
    betas: tuple[float, float]
    eps: float
    warmup_steps: int
    max_steps: int
    schedule: str  # cosine | linear | constant
    min_lr_ratio: float
    max_grad_norm: float  # 0 = no clipping

    @classmethod
    def from_section(cls, section: OptimSection, max_steps: int) -> "OptimConfig":
        warmup = section.warmup_steps
        if warmup is None:
            warmup = default_warmup(max_steps)
        return cls(
            lr=section.lr,
            weight_decay=section.weight_decay,
            betas=(section.adam_beta1, section.adam_beta2),
            eps=section.adam_eps,
            warmup_steps=min(warmup, max_steps),
            max_steps=max_steps,
            schedule=section.schedule,
            min_lr_ratio=section.min_lr_ratio,
            max_grad_norm=section.max_grad_norm,
        )


def default_warmup(max_steps: int) -> int:
    """3% of the steps, but never all of them: the warmup rises from lr 0, so a run that is all warmup (any
    1-step run) would not change the weights at all. An explicit --warmup-steps is the user's, even if it takes
    every step (the --warmup-steps help says so)."""
    return max(0, min(math.ceil(DEFAULT_WARMUP_SHARE * max_steps), max_steps - 1))


def make_adamw(params, cfg: OptimConfig, *, fused: bool | None = None):
    """torch AdamW with `cfg`'s settings (the update both engines run unless DeepSpeed offloads it)."""
    import torch

    return torch.optim.AdamW(
        params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay, fused=fused
    )


def advance_schedule(scheduler) -> float:
    """Advance `scheduler` by one step without an optimizer update (a skipped step: the run keeps its planned
    schedule); returns the learning rate of the step skipped."""
    import warnings

    lr = float(scheduler.get_last_lr()[0])
    with warnings.catch_warnings():  # "scheduler.step() before optimizer.step()": intended here
        warnings.simplefilter("ignore", UserWarning)
        scheduler.step()
    return lr


def make_scheduler(optimizer, cfg: OptimConfig):
    """Linear warmup, then cosine (to min_lr_ratio·lr), linear (to 0) or constant — transformers' schedules."""
    from transformers import get_scheduler

    if cfg.schedule not in SCHEDULES:
        raise ConfigError([f"--schedule {cfg.schedule!r} is not known; use cosine, linear or constant."])
    extra = {"min_lr_rate": cfg.min_lr_ratio} if cfg.schedule == "cosine" else {}
    return get_scheduler(
        SCHEDULES[cfg.schedule], optimizer, num_warmup_steps=cfg.warmup_steps, num_training_steps=cfg.max_steps,
        scheduler_specific_kwargs=extra,
    )


def apply_optim_settings(optimizer, scheduler, cfg: OptimConfig) -> None:
    """After loading a checkpoint: this run's lr, betas, eps and weight decay replace the saved ones.

    `load_state_dict` restores the saved hyperparameters into the optimizer's groups and the scheduler's
    `base_lrs`; the schedule's shape (warmup, length, kind) comes from the scheduler built for this run,
    whose lambdas keep their own arguments. Each group's lr is set where the schedule now stands.
    """
    scheduler.base_lrs = [cfg.lr for _ in optimizer.param_groups]
    step = scheduler.last_epoch
    for group, lr_lambda in zip(optimizer.param_groups, scheduler.lr_lambdas):
        group.update(lr=cfg.lr * lr_lambda(step), betas=tuple(cfg.betas), eps=cfg.eps, weight_decay=cfg.weight_decay)
        if "initial_lr" in group:
            group["initial_lr"] = cfg.lr
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]
