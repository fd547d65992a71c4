"""Capture and restore every random number generator a training step draws from.

An interrupted run resumes *exactly* only if dropout masks, random data choices and any other random
draw after the resume equal those of an uninterrupted run. That needs the state of each generator
the process uses: Python's `random`, NumPy's global generator (when NumPy is installed), torch's CPU
generator and the generator of every CUDA device. Each process captures its own states; in a
distributed run each rank stores its own (see `lstune.train.checkpoint`).

The state is made of plain Python values and uint8 tensors only, so it round-trips through
`torch.save` / `torch.load(weights_only=True)`: NumPy's state is stored as plain lists and numbers
instead of the ndarray NumPy returns, which a weights-only load would refuse to unpickle.
"""

from __future__ import annotations

import logging
import random
from typing import Any

logger = logging.getLogger(__name__)


def capture_rng_state() -> dict[str, Any]:
    """The current state of every generator this process draws from (see the module docstring)."""
    import torch

    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    numpy_state = _capture_numpy()
    if numpy_state is not None:
        state["numpy"] = numpy_state
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Put every generator back into the state `capture_rng_state` returned.

    Generators the state has no entry for are left alone; CUDA states for devices this process does
    not have are skipped with a warning (the run then resumes, but its random draws on those
    devices differ from an uninterrupted run).
    """
    import torch

    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        _restore_numpy(state["numpy"])
    if "cuda" in state:
        _restore_cuda(state["cuda"])


def _capture_numpy() -> dict[str, Any] | None:
    try:
        import numpy as np
    except ImportError:
        return None
    name, keys, pos, has_gauss, cached_gaussian = np.random.get_state(legacy=True)
    return {
        "bit_generator": name,
        "keys": keys.tolist(),
        "pos": int(pos),
        "has_gauss": int(has_gauss),
        "cached_gaussian": float(cached_gaussian),
    }


def _restore_numpy(state: dict[str, Any]) -> None:
    try:
        import numpy as np
    except ImportError:
        logger.warning("the checkpoint holds a NumPy random state but NumPy is not installed; skipped")
        return
    keys = np.asarray(state["keys"], dtype=np.uint32)
    np.random.set_state(
        (state["bit_generator"], keys, state["pos"], state["has_gauss"], state["cached_gaussian"])
    )


def _restore_cuda(states: list) -> None:
    import torch

    available = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if available < len(states):
        logger.warning(
            "the checkpoint holds CUDA random states for %d device(s) but %d are visible; restoring "
            "the first %d, so random draws on the others differ from an uninterrupted run",
            len(states),
            available,
            available,
        )
    for device, device_state in enumerate(states[:available]):
        torch.cuda.set_rng_state(device_state, device)
