"""Shared fixtures. Layer-specific fixtures live in the conftest.py of each test folder."""

from __future__ import annotations

import os

import pytest

# Tests never touch the network: tiny models come from presets, data is generated or shipped.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

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
    """Keep each test on the 2 cores CI has, and deterministic."""
    try:
        import torch
    except ImportError:  # pragma: no cover
        yield
        return
    torch.set_num_threads(2)
    yield
