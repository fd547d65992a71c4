"""Shared fixtures. Layer-specific fixtures live in the conftest.py of each test folder."""

from __future__ import annotations

import os

import pytest

# Tests never touch the network: tiny models come from presets, data is generated or shipped.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# One thread per process: tests run beside each other (and beside gloo workers) on 2 cores, where torch's
# spinning OpenMP threads slow a tiny model down by an order of magnitude.
os.environ.setdefault("OMP_NUM_THREADS", "1")

TINY_ARCHS = [
    "tiny-llama",
    "tiny-mistral",
    "tiny-qwen2",
    "tiny-qwen3",
    "tiny-gemma2",
    "tiny-gemma3",
    "tiny-phi3",
    "tiny-qwen3-moe",
    "tiny-mixtral",
]


@pytest.fixture(autouse=True)
def _torch_threads():
    """One intra-op thread per test process (see OMP_NUM_THREADS above)."""
    try:
        import torch
    except ImportError:  # pragma: no cover
        yield
        return
    torch.set_num_threads(1)
    yield


@pytest.fixture(autouse=True)
def _lstune_logger_reset():
    """An in-process CLI call (in a test or a module-scoped fixture) configures the `lstune` logger for a
    terminal: its own handler, no propagation. Reset it before each test so `caplog` sees lstune's records
    whatever ran before."""
    import logging

    from lstune.cli.logs import _MARK

    logger = logging.getLogger("lstune")
    for handler in [h for h in logger.handlers if getattr(h, _MARK, False)]:
        logger.removeHandler(handler)
    logger.setLevel(logging.NOTSET)
    logger.propagate = True
    yield
