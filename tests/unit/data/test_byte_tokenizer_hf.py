"""A preset's byte tokenizer, saved with a model, loads with AutoTokenizer and encodes exactly as lstune does."""

from __future__ import annotations

from transformers import AutoTokenizer

from lstune.data.tokenizer import ByteTokenizer


def test_saved_byte_tokenizer_loads_with_autotokenizer_and_agrees(tmp_path):
    ours = ByteTokenizer()
    ours.save_pretrained(tmp_path)
    hf = AutoTokenizer.from_pretrained(tmp_path)
    assert len(hf) == ours.vocab_size
    assert (hf.pad_token_id, hf.bos_token_id, hf.eos_token_id) == (0, 1, 2)
    for text in ["hello world", " leading space", "héllo  wörld\n\ttabs 🎉", ""]:
        assert hf.encode(text) == ours.encode(text), text
        assert hf.decode(hf.encode(text), skip_special_tokens=True) == text
    messages = [{"role": "user", "content": "où?"}, {"role": "assistant", "content": "ici"}]
    assert hf.apply_chat_template(messages, tokenize=True)["input_ids"] == ours.apply_chat_template(messages)
    assert ByteTokenizer.saved_in(tmp_path), "lstune still recognises its own tokenizer in the folder"
