"""CUDA caching-allocator settings for long sequences (ALST Sec. 3.3).

Long-sequence steps allocate and free tensors of many sizes (tiles, per-layer recomputes, offload
buffers); with the default allocator the reserved-but-unusable fragments grow until an
out-of-memory at far below the card's size. `expandable_segments:True` lets the allocator grow one
segment instead of carving new fixed blocks, which ALST found removes most of that fragmentation.
This module does not import torch: the setting only works if it is in the environment before CUDA
initialises, so the training loop calls it first.
"""

from __future__ import annotations

import logging
import os
import sys

logger = logging.getLogger("lstune")

_VARIABLES = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")  # the latter is torch >= 2.9's new name
_SETTING = "expandable_segments:True"


def ensure_expandable_segments() -> bool:
    """Set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True unless the user configured the allocator.

    Returns True when this call set it. Warns when CUDA is already initialised (too late to matter).
    """
    user_set = [name for name in _VARIABLES if os.environ.get(name)]
    if user_set:
        logger.info("allocator: keeping the user's %s=%s", user_set[0], os.environ[user_set[0]])
        return False
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = _SETTING
    if _cuda_initialised():
        logger.warning("allocator: CUDA is already initialised, so %s takes effect only in new processes", _SETTING)
    else:
        logger.info("allocator: PYTORCH_CUDA_ALLOC_CONF=%s", _SETTING)
    return True


def _cuda_initialised() -> bool:
    torch = sys.modules.get("torch")  # never import torch here: that alone can be too early a CUDA init
    return bool(torch is not None and torch.cuda.is_initialized())
