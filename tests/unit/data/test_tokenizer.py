from __future__ import annotations

import json

import pytest

from lstune.data.tokenizer import ByteTokenizer
from lstune.errors import ModelError
from lstune.models.presets import get_preset
from tests.conftest import TINY_ARCHS


def test_ids_are_bytes_plus_three_after_bos(byte_tok):
    assert byte_tok.encode("Hi") == [1, ord("H") + 3, ord("i") + 3]
    assert byte_tok.encode("Hi", add_special_tokens=False) == [ord("H") + 3, ord("i") + 3]
    assert (byte_tok.pad_token_id, byte_tok.bos_token_id, byte_tok.eos_token_id) == (0, 1, 2)
    assert byte_tok.vocab_size == len(byte_tok) == 259


def test_extreme_bytes_map_to_the_ends_of_the_id_range(byte_tok):
    top = [0xF4 + 3, 0x8F + 3, 0xBF + 3, 0xBF + 3]  # U+10FFFF, the largest code point
    assert byte_tok.encode("\x00\U0010ffff", add_special_tokens=False) == [3, *top]
    assert byte_tok.decode([255 + 3]) == "\ufffd"  # byte 0xFF, never valid UTF-8 alone


@pytest.mark.parametrize("preset", TINY_ARCHS)
def test_the_vocabulary_fits_every_tiny_preset(byte_tok, preset):
    assert byte_tok.vocab_size == 259 <= get_preset(preset).config["vocab_size"]


def test_decode_round_trips_unicode_and_shows_specials(byte_tok):
    text = "naïve 日本 ✓"
    ids = byte_tok.encode(text) + [byte_tok.eos_token_id, byte_tok.pad_token_id]
    assert byte_tok.decode(ids) == f"<s>{text}</s><pad>"
    assert byte_tok.decode(ids, skip_special_tokens=True) == text


def test_batch_call_matches_encode(byte_tok):
    out = byte_tok(["ab", ""], add_special_tokens=True)
    assert out["input_ids"] == [byte_tok.encode("ab"), [1]]
    assert byte_tok("ab")["input_ids"] == byte_tok.encode("ab")


def test_chat_format_is_bos_then_role_header_content_eos(byte_tok):
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    enc = lambda s: byte_tok.encode(s, add_special_tokens=False)  # noqa: E731
    assert byte_tok.apply_chat_template(msgs) == [1, *enc("<|user|>\nq"), 2, *enc("<|assistant|>\na"), 2]
    prompt = byte_tok.apply_chat_template(msgs[:1], add_generation_prompt=True)
    assert prompt == [1, *enc("<|user|>\nq"), 2, *enc("<|assistant|>\n")]
    assert byte_tok.apply_chat_template(msgs, tokenize=False) == "<s><|user|>\nq</s><|assistant|>\na</s>"


def test_chat_template_string_renders_the_same_text(byte_tok):
    import jinja2

    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}]
    rendered = jinja2.Template(byte_tok.chat_template).render(
        messages=msgs, add_generation_prompt=True, bos_token="<s>", eos_token="</s>"
    )
    assert rendered == byte_tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)


def test_save_and_load_round_trip(tmp_path, byte_tok):
    (path,) = byte_tok.save_pretrained(tmp_path / "model")
    assert json.loads(open(path).read())["tokenizer_class"] == "ByteTokenizer"
    assert ByteTokenizer.saved_in(tmp_path / "model")
    assert ByteTokenizer.from_pretrained(tmp_path / "model").encode("x") == byte_tok.encode("x")


def test_loading_from_a_folder_without_it_says_what_to_do(tmp_path):
    assert not ByteTokenizer.saved_in(tmp_path)
    with pytest.raises(ModelError, match="no lstune_tokenizer.json.*AutoTokenizer"):
        ByteTokenizer.from_pretrained(tmp_path)


@pytest.mark.parametrize("body, fragment", [
    ("{not json", "tokenizer.json is not valid JSON"),
    ('{"a":' + "[" * 100_000 + "]" * 100_000 + "}", "tokenizer.json is nested too deeply"),
    ('{"model": 5}', "its tokenizer (tokenizer.json, tokenizer_config.json in"),
])
def test_a_model_folders_broken_tokenizer_is_refused_not_replaced_by_bytes(tmp_path, body, fragment):
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    from lstune.data.tokenizer import load_model_tokenizer
    from lstune.errors import ModelError

    words = Tokenizer(models.WordLevel({"<unk>": 0, "a": 1}, unk_token="<unk>"))
    PreTrainedTokenizerFast(tokenizer_object=words, unk_token="<unk>").save_pretrained(tmp_path)
    (tmp_path / "tokenizer.json").write_text(body)
    with pytest.raises(ModelError) as caught:
        load_model_tokenizer("local", str(tmp_path), name="m", vocab_size=320)
    assert fragment in str(caught.value)
