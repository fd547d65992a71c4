"""Fixtures for the data layer: an isolated datasets cache and tokenizers built offline."""

from __future__ import annotations

import pytest

from lstune.data.tokenizer import ByteTokenizer
from tests.unit.data._helpers import make_word_tokenizer


@pytest.fixture(autouse=True, scope="session")
def _isolated_datasets_cache(tmp_path_factory):
    """Keep the Arrow files datasets writes (and lstune's tokenized cache) out of ~/.cache."""
    import datasets

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path_factory.mktemp("hf_datasets_cache"))
        datasets.disable_progress_bars()
        yield
        datasets.enable_progress_bars()


@pytest.fixture
def byte_tok() -> ByteTokenizer:
    return ByteTokenizer()


@pytest.fixture
def word_tok():
    return make_word_tokenizer()
