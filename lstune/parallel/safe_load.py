"""Read DeepSpeed's pickled checkpoint files without running code from them.

DeepSpeed loads its checkpoint files with `torch.load(weights_only=False)`: a full unpickler, which runs
whatever callable a crafted file names (a checkpoint is then a program). lstune swaps in, for its own
engine object only, a loader that uses torch's restricted unpickler (`weights_only=True`): tensors,
plain containers and numbers, plus the few DeepSpeed classes its own checkpoints hold (`ALLOWED`, all
plain records whose construction has no side effect). A file that needs anything else is refused before
any of it is used; `--trust-checkpoint` restores DeepSpeed's own loader for checkpoints the user trusts.
"""

from __future__ import annotations

import importlib
import pickle
from typing import Any

from lstune.errors import CheckpointError

# What DeepSpeed 0.19 writes into ZeRO 1-3 checkpoints besides tensors and builtins (found with
# torch.serialization.get_unsafe_globals_in_checkpoint on checkpoints of every stage).
ALLOWED = (
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.utils.tensor_fragment.fragment_address",
    "deepspeed.runtime.zero.config.ZeroStageEnum",
)


def allowed_globals() -> list[Any]:
    found = []
    for name in ALLOWED:
        module, _, attr = name.rpartition(".")
        try:
            found.append(getattr(importlib.import_module(module), attr))
        except (ImportError, AttributeError):
            continue  # another DeepSpeed version: its files will name what they need, and be refused
    return found


def restricted_load(path: str, map_location: Any = None) -> Any:
    """torch.load with the restricted unpickler; CheckpointError naming the file when it needs more."""
    import torch

    with torch.serialization.safe_globals(allowed_globals()):
        try:
            return torch.load(path, map_location=map_location, weights_only=True)
        except pickle.UnpicklingError as exc:
            detail = str(exc).split("WeightsUnpickler error:")[-1].strip().splitlines()[0][:300]
            raise CheckpointError(
                f"{path} holds Python objects that loading would have to execute ({detail}); lstune does not run "
                "code from a checkpoint. If you wrote this checkpoint yourself or otherwise trust it, resume with "
                "--trust-checkpoint."
            ) from None


def use_restricted_loader(ds_engine: Any) -> None:
    """Make this DeepSpeed engine read checkpoint files with `restricted_load` (its other state untouched)."""
    ds_engine.checkpoint_engine.load = restricted_load
