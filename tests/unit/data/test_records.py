"""Record kinds, tokenization and pre-shifted labels of single documents."""

from __future__ import annotations

import numpy as np
import pytest

from lstune.data.records import IGNORE, check_tokenizer, detect_kind, shift_labels, tokenize_batch
from lstune.errors import DataError
from tests.unit.data._helpers import make_word_tokenizer

X = IGNORE


def _docs(kind: str, batch: dict, tokenizer) -> list[tuple[list[int], list[int]]]:
    n = len(next(iter(batch.values())))
    out = tokenize_batch(batch, list(range(n)), kind=kind, tokenizer=tokenizer)
    return [(ids.tolist(), labels.tolist()) for ids, labels in zip(out["input_ids"], out["shift_labels"])]


def test_kind_detection_first_match_wins_and_reports_fields():
    assert detect_kind(["messages", "text", "id"]).name == "text"
    assert detect_kind(["input_ids", "messages"]).name == "messages"
    kind = detect_kind(["attention_mask", "labels", "input_ids"])
    assert (kind.name, kind.fields) == ("input_ids", ("input_ids", "labels", "attention_mask"))


def test_no_known_field_lists_the_columns_and_the_accepted_ones():
    with pytest.raises(DataError, match=r"columns \['body', 'title'\].*'text'.*'messages'.*'input_ids'"):
        detect_kind(["title", "body"])


def test_shift_puts_the_next_label_and_ignores_the_last_position():
    assert shift_labels(np.array([5, 6, X, 8])).tolist() == [6, X, 8, X]


def test_text_gets_bos_and_eos_and_loss_on_every_next_token(byte_tok):
    ((ids, labels),) = _docs("text", {"text": ["ab"]}, byte_tok)
    a, b = ord("a") + 3, ord("b") + 3
    assert ids == [1, a, b, 2]
    assert labels == [a, b, 2, X]


def test_text_with_hf_tokenizer_adds_eos_once_and_empty_text_is_an_empty_document(word_tok):
    (ids, labels), (empty_ids, _) = _docs("text", {"text": ["hello world", ""]}, word_tok)
    hello, world = word_tok.convert_tokens_to_ids(["hello", "world"])
    assert ids == [word_tok.bos_token_id, hello, world, word_tok.eos_token_id]
    assert labels == [hello, world, word_tok.eos_token_id, X]
    assert empty_ids == []


def test_text_with_a_tokenizer_that_adds_eos_itself_gets_no_second_eos():
    tok = make_word_tokenizer(adds_eos=True)
    ((ids, _),) = _docs("text", {"text": ["hello"]}, tok)
    assert tok.convert_ids_to_tokens(ids) == ["<s>", "hello", "</s>"]


def test_pretokenized_labels_are_shifted_and_padding_dropped():
    batch = {
        "input_ids": [[7, 8, 9, 10, 0]],
        "labels": [[X, X, 9, 10, X]],
        "attention_mask": [[1, 1, 1, 1, 0]],
    }
    ((ids, labels),) = _docs("input_ids", batch, tokenizer=None)
    assert ids == [7, 8, 9, 10]
    assert labels == [X, 9, 10, X]


def test_pretokenized_without_labels_trains_on_every_token():
    ((ids, labels),) = _docs("input_ids", {"input_ids": [[4, 5, 6]]}, tokenizer=None)
    assert (ids, labels) == ([4, 5, 6], [5, 6, X])


def test_misaligned_labels_name_the_record():
    with pytest.raises(DataError, match="record 1: input_ids has 2 tokens but .* have 3/2"):
        _docs("input_ids", {"input_ids": [[1], [1, 2]], "labels": [[1], [1, 2, 3]]}, tokenizer=None)


CHAT = [
    {"role": "system", "content": "a"},
    {"role": "user", "content": "how are you"},
    {"role": "assistant", "content": "fine thanks"},
    {"role": "user", "content": "what"},
    {"role": "assistant", "content": "b c"},
]


def test_chat_loss_is_only_on_assistant_content_and_end_of_turn_bytes(byte_tok):
    ((ids, labels),) = _docs("messages", {"messages": [CHAT]}, byte_tok)
    assert ids == byte_tok.apply_chat_template(CHAT)
    trained = [ids[t + 1] for t in range(len(ids) - 1) if labels[t] != X]
    answer = lambda s: byte_tok.encode(s, add_special_tokens=False) + [byte_tok.eos_token_id]  # noqa: E731
    assert trained == answer("fine thanks") + answer("b c")
    assert all(labels[t] in (X, ids[t + 1]) for t in range(len(ids) - 1))


def test_chat_loss_with_a_real_hf_tokenizer_and_template(word_tok):
    ((ids, labels),) = _docs("messages", {"messages": [CHAT]}, word_tok)
    tokens = word_tok.convert_ids_to_tokens([ids[t + 1] for t in range(len(ids) - 1) if labels[t] != X])
    assert tokens == ["fine", "thanks", "<|im_end|>", "b", "c", "<|im_end|>"]


def test_template_that_rewrites_earlier_turns_is_refused():
    unstable = make_word_tokenizer(
        "{% for m in messages %}<|im_start|>{{ m['role'] }} "
        "{% if m['role'] == 'assistant' and not loop.last %}a{% else %}{{ m['content'] }}{% endif %}"
        " <|im_end|> "
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant {% endif %}"
    )
    with pytest.raises(DataError, match="record 0: the tokenizer's chat template is not prefix-stable"):
        _docs("messages", {"messages": [CHAT]}, unstable)


def test_template_errors_become_data_errors():
    # A template that rejects this record (a system turn), not every conversation: the record is named.
    strict = make_word_tokenizer("{% if messages[0]['role'] == 'system' %}{{ raise_exception('roles must alternate') }}"
                                 "{% endif %}{% for m in messages %}{{ m['content'] }} {% endfor %}")
    with pytest.raises(DataError, match="record 0: the tokenizer's chat template failed.*must alternate"):
        _docs("messages", {"messages": [CHAT]}, strict)


def test_a_template_that_fails_on_every_conversation_is_blamed_not_the_record():
    broken = make_word_tokenizer("{% for m in messages %}{{ m['content'] | no_such_filter }}{% endfor %}")
    broken.lstune_chat_template = "my-template.jinja"
    with pytest.raises(DataError, match=r"--chat-template 'my-template.jinja' cannot render a conversation.*the "
                                        r"template is at fault, not record 0") as caught:
        _docs("messages", {"messages": [CHAT]}, broken)
    assert not str(caught.value).startswith("record 0")


def test_a_template_that_renders_forever_is_stopped(monkeypatch):
    import time

    from lstune.data import templates

    monkeypatch.setattr(templates, "RENDER_SECONDS", 1.0)
    endless = make_word_tokenizer("{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}"
                                  "{% for m in messages %}{{ m['content'] }} {% endfor %}")
    started = time.monotonic()
    with pytest.raises(DataError, match="cannot render a conversation.*rendered for more than 1 s"):
        _docs("messages", {"messages": [CHAT]}, endless)
    assert time.monotonic() - started < 10


def test_malformed_messages_name_the_record(byte_tok):
    with pytest.raises(DataError, match=r"record 1: 'messages' must be a list of \{role, content\}"):
        _docs("messages", {"messages": [CHAT, "hello"]}, byte_tok)


def test_chat_data_needs_a_chat_template():
    with pytest.raises(DataError, match="no chat template.*'text' field"):
        check_tokenizer(detect_kind(["messages"]), make_word_tokenizer(chat_template=None))


def test_a_source_mixing_record_kinds_is_refused_naming_it_and_both_kinds(tmp_path, byte_tok):
    from lstune.data.dataset import build_dataset
    from tests.unit.data._helpers import write_jsonl

    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "there"}]
    path = write_jsonl(tmp_path / "mixed.jsonl", [{"text": "plain"}, {"messages": chat}, {"messages": chat}])
    with pytest.raises(DataError, match=r"mixed\.jsonl mixes two kinds of records: 1 with 'text' \(text\) and 2 "
                                        r"with 'messages' \(messages\) instead, e\.g\. record 1"):
        build_dataset(str(path), byte_tok, 64)
    # A null field of the detected kind alone is still an empty record, skipped and counted.
    blank = write_jsonl(tmp_path / "blank.jsonl", [{"text": "plain"}, {"text": None, "id": 3}])
    assert build_dataset(str(blank), byte_tok, 64).summary()["skipped_documents"] == 1


NULL_TURN = [{"role": "user", "content": "q"}, {"role": "assistant", "content": None},
             {"role": "user", "content": "q2"}, {"role": "assistant", "content": "a2"}]
NAIVE = "{% for m in messages %}<|im_start|>{{ m['role'] }} {{ m['content'] }} <|im_end|> {% endfor %}" \
        "{% if add_generation_prompt %}<|im_start|>assistant {% endif %}"


@pytest.mark.parametrize("tokenizer", ["byte", "hf"])
def test_null_content_is_refused_not_trained_as_the_text_none(byte_tok, tokenizer):
    tok = byte_tok if tokenizer == "byte" else make_word_tokenizer(NAIVE)
    with pytest.raises(DataError, match=r"record 1: message 1 \(assistant\) has no content \(null\)"):
        _docs("messages", {"messages": [CHAT, NULL_TURN]}, tok)


def test_null_content_of_a_tool_call_turn_needs_a_template_that_renders_it(byte_tok):
    calls = [{**m, "tool_calls": [{"name": "f"}]} if m["content"] is None else m for m in NULL_TURN]
    with pytest.raises(DataError, match=r"record 0: .*ValueError: message 1 \(assistant\) has content null; "
                                        "lstune's byte-level chat format renders text only"):
        _docs("messages", {"messages": [calls]}, byte_tok)
    with pytest.raises(DataError, match=r"record 0: message 1 \(assistant\) has no content \(null\), and the chat "
                                        "template ignores tool_calls, so it would be trained as an empty answer"):
        _docs("messages", {"messages": [calls]}, make_word_tokenizer(NAIVE))
    prints_none = "{% for m in messages %}{{ m.role }} {{ m.content }} {% for c in m.tool_calls %}{{ c.name }} " \
                  "{% endfor %}{% endfor %}"
    with pytest.raises(DataError, match=r"message 1 \(assistant\) has no content \(null\), and the chat template "
                                        "prints the null content as the text 'None'"):
        _docs("messages", {"messages": [calls]}, _NoneKeepingTokenizer(prints_none, byte_tok))
    aware = make_word_tokenizer(NAIVE.replace(
        "{{ m['content'] }}", "{% if m['tool_calls'] %}{% for c in m['tool_calls'] %}what {{ c['name'] }}{% endfor %}"
                              "{% else %}{{ m['content'] }}{% endif %}"))
    ((ids, labels),) = _docs("messages", {"messages": [calls]}, aware)
    trained = aware.convert_ids_to_tokens([ids[t + 1] for t in range(len(ids) - 1) if labels[t] != X])
    assert trained[:3] == ["what", "f", "<|im_end|>"]  # the tool call is what the turn trains on


class _NoneKeepingTokenizer:
    """A tokenizer whose template sees None values (transformers before None-dropping, other renderers)."""

    def __init__(self, chat_template: str, byte_tok):
        self.chat_template, self.byte_tok = chat_template, byte_tok

    def apply_chat_template(self, messages, tokenize=True, add_generation_prompt=False, **_):
        from transformers.utils.chat_template_utils import render_jinja_template

        (text,), _ = render_jinja_template([list(messages)], chat_template=self.chat_template,
                                           add_generation_prompt=add_generation_prompt)
        return self.byte_tok.encode(text) if tokenize else text


def test_list_content_is_refused_where_the_template_prints_its_repr(byte_tok):
    parts = [{"role": "user", "content": [{"type": "text", "text": "hello"}]}, {"role": "assistant", "content": "a"}]
    with pytest.raises(DataError, match=r"message 0 \(user\) has content list; lstune's byte-level chat format"):
        _docs("messages", {"messages": [parts]}, byte_tok)
    with pytest.raises(DataError, match=r"message 0 \(user\) has a list as content, and the chat template prints "
                                        "the list as its Python text"):
        _docs("messages", {"messages": [parts]}, make_word_tokenizer(NAIVE))
    reads_parts = make_word_tokenizer(NAIVE.replace(
        "{{ m['content'] }}", "{% if m['content'] is string %}{{ m['content'] }}{% else %}"
                              "{% for p in m['content'] %}{{ p['text'] }}{% endfor %}{% endif %}"))
    ((ids, _),) = _docs("messages", {"messages": [parts]}, reads_parts)
    assert "hello" in reads_parts.decode(ids)
