"""Prompt/completion, Alpaca and ShareGPT records, mapped onto the existing kinds; --chat-template. Token level."""

from __future__ import annotations

import pytest

from lstune.data.records import IGNORE, check_tokenizer, detect_kind, tokenize_batch
from lstune.data.templates import KNOWN_TEMPLATES, check_chat_template, read_chat_template, set_chat_template
from lstune.data.tokenizer import ByteTokenizer
from lstune.errors import DataError
from tests.unit.data._helpers import make_word_tokenizer

X = IGNORE


def docs(kind: str, batch: dict, tokenizer) -> list[tuple[list[int], list[int]]]:
    n = len(next(iter(batch.values())))
    out = tokenize_batch(batch, list(range(n)), kind=kind, tokenizer=tokenizer)
    return [(ids.tolist(), labels.tolist()) for ids, labels in zip(out["input_ids"], out["shift_labels"])]


def trained(ids: list[int], shifted: list[int]) -> list[int]:
    """The target tokens, checking every shifted label is the next id or ignored."""
    assert shifted[-1] == X
    assert all(shifted[t] in (X, ids[t + 1]) for t in range(len(ids) - 1))
    return [ids[t + 1] for t in range(len(ids) - 1) if shifted[t] != X]


def raw(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


@pytest.mark.parametrize(
    "columns, kind, fields",
    [
        (["completion", "prompt"], "prompt_completion", ("prompt", "completion")),
        (["instruction", "input", "output"], "alpaca", ("instruction", "output", "input")),
        (["instruction", "output", "system"], "alpaca", ("instruction", "output", "system")),
        (["conversations", "id"], "sharegpt", ("conversations",)),
        (["conversations", "system"], "sharegpt", ("conversations", "system")),
        (["text", "prompt", "completion"], "text", ("text",)),
    ],
)
def test_kind_detection(columns, kind, fields):
    detected = detect_kind(columns)
    assert (detected.name, detected.fields) == (kind, fields)


def test_prompt_completion_exact_ids_and_loss_on_the_completion_only():
    tok = ByteTokenizer()
    ((ids, shifted),) = docs("prompt_completion", {"prompt": ["Q: 2+2?"], "completion": [" A: 4"]}, tok)
    prompt = [tok.bos_token_id, *raw(tok, "Q: 2+2?")]
    completion = [*raw(tok, " A: 4"), tok.eos_token_id]
    assert ids == prompt + completion
    assert shifted == [X] * (len(prompt) - 1) + completion + [X]


def test_prompt_completion_with_a_real_tokenizer():
    tok = make_word_tokenizer()
    ((ids, shifted),) = docs("prompt_completion", {"prompt": ["how are you"], "completion": ["fine thanks"]}, tok)
    assert tok.convert_ids_to_tokens(ids) == ["<s>", "how", "are", "you", "fine", "thanks", "</s>"]
    assert tok.convert_ids_to_tokens(trained(ids, shifted)) == ["fine", "thanks", "</s>"]


def test_conversational_prompt_completion_trains_only_the_completion_turns():
    tok = ByteTokenizer()
    prompt = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
              {"role": "user", "content": "how are you"}]
    completion = [{"role": "assistant", "content": "fine"}]
    ((ids, shifted),) = docs("prompt_completion", {"prompt": [prompt], "completion": [completion]}, tok)
    assert ids == tok.apply_chat_template(prompt + completion)
    assert trained(ids, shifted) == [*raw(tok, "fine"), tok.eos_token_id]


def test_prompt_and_completion_of_different_shapes_name_the_record():
    with pytest.raises(DataError, match="record 1: 'prompt' and 'completion' must both be strings.*str and list"):
        docs("prompt_completion", {"prompt": ["a", "b"], "completion": ["c", [{"role": "assistant", "content": "d"}]]},
             ByteTokenizer())


def test_alpaca_maps_to_messages_and_trains_the_output():
    tok = ByteTokenizer()
    batch = {"instruction": ["Add", "Greet"], "input": ["2 and 2", ""], "output": ["4", "hello"],
             "system": ["be brief", None]}
    (first, second) = docs("alpaca", batch, tok)
    expected = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "Add\n2 and 2"},
                {"role": "assistant", "content": "4"}]
    assert first[0] == tok.apply_chat_template(expected)
    assert trained(*first) == [*raw(tok, "4"), tok.eos_token_id]
    assert second[0] == tok.apply_chat_template([{"role": "user", "content": "Greet"},
                                                 {"role": "assistant", "content": "hello"}])
    assert trained(*second) == [*raw(tok, "hello"), tok.eos_token_id]


def test_alpaca_with_a_real_template():
    tok = make_word_tokenizer()
    ((ids, shifted),) = docs("alpaca", {"instruction": ["how are you"], "output": ["fine thanks"]}, tok)
    assert tok.convert_ids_to_tokens(trained(ids, shifted)) == ["fine", "thanks", "<|im_end|>"]


def test_sharegpt_maps_speakers_and_trains_every_gpt_turn():
    tok = ByteTokenizer()
    turns = [{"from": "system", "value": "s"}, {"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"},
             {"from": "human", "value": "and?"}, {"from": "gpt", "value": "done"}]
    ((ids, shifted),) = docs("sharegpt", {"conversations": [turns]}, tok)
    roles = {"system": "system", "human": "user", "gpt": "assistant"}
    assert ids == tok.apply_chat_template([{"role": roles[t["from"]], "content": t["value"]} for t in turns])
    assert trained(ids, shifted) == [*raw(tok, "yo"), tok.eos_token_id, *raw(tok, "done"), tok.eos_token_id]


def test_sharegpt_unknown_speaker_and_malformed_turns_name_the_record():
    tok = ByteTokenizer()
    with pytest.raises(DataError, match="record 0: a ShareGPT turn is from 'observation'"):
        docs("sharegpt", {"conversations": [[{"from": "observation", "value": "x"}]]}, tok)
    with pytest.raises(DataError, match=r"record 0: ShareGPT 'conversations' must be a list of \{from, value\}"):
        docs("sharegpt", {"conversations": [[{"role": "user", "content": "x"}]]}, tok)


@pytest.mark.parametrize("kind", ["alpaca", "sharegpt"])
def test_chat_formats_need_a_template_and_the_error_names_the_flag(kind):
    columns = {"alpaca": ["instruction", "output"], "sharegpt": ["conversations"]}[kind]
    with pytest.raises(DataError, match="no chat template. Give one with --chat-template"):
        check_tokenizer(detect_kind(columns), make_word_tokenizer(chat_template=None))


def test_chatml_by_name_on_the_byte_tokenizer_renders_and_masks_exactly():
    tok = ByteTokenizer()
    assert set_chat_template(tok, "chatml") == "chat template: chatml (--chat-template)"
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    ((ids, shifted),) = docs("messages", {"messages": [messages]}, tok)
    assert ids == raw(tok, "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nyo<|im_end|>\n")
    assert trained(ids, shifted) == raw(tok, "yo<|im_end|>\n")
    assert ByteTokenizer().apply_chat_template(messages) != ids  # the instance's template, not the class's


def test_llama3_template_renders_bos_as_its_id():
    tok = ByteTokenizer()
    set_chat_template(tok, "llama3")
    ids = tok.apply_chat_template([{"role": "user", "content": " hi "}])
    assert ids == [tok.bos_token_id, *raw(tok, "<|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>")]


def test_template_from_a_file_on_a_real_tokenizer(tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text("{% for m in messages %}{{ m['role'] }} {{ m['content'] }} </s> {% endfor %}"
                    "{% if add_generation_prompt %}assistant {% endif %}")
    tok = make_word_tokenizer(chat_template=None)
    set_chat_template(tok, str(path))
    ((ids, shifted),) = docs("alpaca", {"instruction": ["how are you"], "output": ["fine"]}, tok)
    assert tok.convert_ids_to_tokens(ids) == ["user", "how", "are", "you", "</s>", "assistant", "fine", "</s>"]
    assert tok.convert_ids_to_tokens(trained(ids, shifted)) == ["fine", "</s>"]


def test_bad_chat_template_values(tmp_path):
    with pytest.raises(DataError, match="'vicuna' is neither a known template \\(chatml, llama3\\) nor a file"):
        check_chat_template("vicuna")
    not_chat = tmp_path / "x.jinja"
    not_chat.write_text("{{ bos_token }}")
    with pytest.raises(DataError, match="never reads `messages`"):
        check_chat_template(str(not_chat))
    check_chat_template(None)
    assert read_chat_template("ChatML") == KNOWN_TEMPLATES["chatml"]
