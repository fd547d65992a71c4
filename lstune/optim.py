"""Learning-rate schedules shared by both engines (single-device AdamW and DeepSpeed)."""

from __future__ import annotations

from lstune.errors import ConfigError

SCHEDULES = {"cosine": "cosine_with_min_lr", "linear": "linear", "constant": "constant_with_warmup"}


def make_scheduler(optimizer, *, schedule: str, warmup_steps: int, max_steps: int, min_lr_ratio: float):
    """Linear warmup, then cosine (to min_lr_ratio·lr), linear (to 0) or constant — transformers' schedules."""
    from transformers import get_scheduler

    if schedule not in SCHEDULES:
        raise ConfigError([f"--schedule {schedule!r} is not known; use cosine, linear or constant."])
    extra = {"min_lr_rate": min_lr_ratio} if schedule == "cosine" else {}
    return get_scheduler(
        SCHEDULES[schedule], optimizer, num_warmup_steps=warmup_steps, num_training_steps=max_steps,
        scheduler_specific_kwargs=extra,
    )


def apply_optim_settings(optimizer, scheduler, cfg) -> None:
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
