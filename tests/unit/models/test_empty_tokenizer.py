"""A model folder without tokenizer files: transformers 5 builds an empty tokenizer; lstune falls back to bytes."""

from __future__ import annotations

import pytest

from lstune.data.tokenizer import ByteTokenizer, is_empty_tokenizer
from lstune.data.tokenizer import load_model_tokenizer
from tests.support.archs import tiny_config


@pytest.mark.parametrize("model_type", ["gpt2", "qwen2"])
def test_an_empty_tokenizer_falls_back_to_bytes_and_says_so(model_type, tmp_path):
    tiny_config(model_type).save_pretrained(tmp_path)
    from transformers import AutoTokenizer

    assert is_empty_tokenizer(AutoTokenizer.from_pretrained(tmp_path))  # what transformers gives here
    tokenizer, notes = load_model_tokenizer("local", str(tmp_path), name=str(tmp_path), vocab_size=320)
    assert isinstance(tokenizer, ByteTokenizer) and tokenizer("hi")["input_ids"]
    assert any("empty tokenizer" in note for note in notes)
    assert any("byte-level tokenizer" in note for note in notes)


def test_a_real_tokenizer_is_kept(tmp_path):
    tokenizer = ByteTokenizer()
    assert not is_empty_tokenizer(tokenizer)
