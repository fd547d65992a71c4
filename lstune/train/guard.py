"""Stop (or, when asked, skip) a step whose loss or gradient norm is not finite.

A NaN or infinite loss or gradient norm means the step's update would turn the weights into NaN; every
later step, checkpoint and the final model would carry them. The default is to stop at once, saving
nothing from that step, so the newest checkpoint is the last one written before it (always one taken
from finite weights). With `--skip-nonfinite-steps`, the single-device engine leaves the weights
untouched for that step (its update is skipped before it is applied) and the run goes on; after
`MAX_CONSECUTIVE_SKIPS` such steps in a row it stops anyway, since skipping is not recovering.

Under DeepSpeed the check is DeepSpeed's own (0.19: every ZeRO stage, offloaded or not): it drops non-finite
gradients inside `step()` and leaves the weights, and lstune advances the schedule as on one device
(lstune.parallel.engine_ds.DeepSpeedEngine.step). The one step no engine can skip is a non-finite loss with
finite gradients under DeepSpeed (its update is applied before lstune could drop them): that stops the run.

A step whose window has no loss-carrying token at all (label_tokens 0) has a NaN loss by definition (a mean
over no tokens), not from divergence: lstune.train.step skipped its update, and it is reported as that.
"""

from __future__ import annotations

import math
from pathlib import Path

from lstune.errors import UserError

MAX_CONSECUTIVE_SKIPS = 10


class DivergedError(UserError):
    """Training produced a non-finite loss or gradient norm and stopped."""


class NonFiniteGuard:
    def __init__(self, *, skip: bool):
        self.skip = skip
        self.consecutive = 0
        self.skipped = 0

    def check(self, record: dict, newest_checkpoint: Path | None) -> str | None:
        """None for a finite step; a note for a skipped one; raises DivergedError when the run must stop."""
        if record.get("label_tokens") == 0 and record.get("update_skipped"):
            return empty_window_note(record)
        problem = nonfinite_problem(record)
        if problem is None:
            self.consecutive = 0
            return None
        self.consecutive += 1
        if self.skip and record.get("update_skipped") and self.consecutive <= MAX_CONSECUTIVE_SKIPS:
            self.skipped += 1
            return f"step {record['step']}: {problem}; the update was skipped (--skip-nonfinite-steps)"
        raise DivergedError(_stop_message(record["step"], problem, newest_checkpoint, self))


def empty_window_note(record: dict) -> str:
    return (f"step {record['step']}: no token of this step's samples carries a loss (every label is -100), so it has "
            "no loss and nothing to learn: its update was skipped (weights and optimizer state unchanged, the "
            "learning-rate schedule advanced). If this repeats, check the data's labels.")


def nonfinite_problem(record: dict) -> str | None:
    bad = [f"{key} is {record[key]}" for key in ("loss", "grad_norm")
           if isinstance(record.get(key), float) and not math.isfinite(record[key])]
    return " and ".join(bad) or None


def _stop_message(step: int, problem: str, newest: Path | None, guard: NonFiniteGuard) -> str:
    kept = (f"The newest checkpoint, {newest}, is from before it." if newest is not None
            else "No checkpoint had been saved yet.")
    why = (f"{guard.consecutive} steps in a row were not finite; skipping does not recover the run"
           if guard.skip and guard.consecutive > MAX_CONSECUTIVE_SKIPS
           else "the update could not be skipped (DeepSpeed found the gradients finite and applied it)" if guard.skip
           else "training stopped before that step could reach a checkpoint")
    return (
        f"step {step}: {problem}: training diverged; {why}. Nothing from this step was saved and no final model "
        f"was written. {kept} Lower --lr, check the data, or pass --skip-nonfinite-steps to skip such steps."
    )
