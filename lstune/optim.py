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
