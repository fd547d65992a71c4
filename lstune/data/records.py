"""Turn raw records into tokenized documents with pre-shifted labels.

A record kind is detected from the columns (the first match wins; a source whose rows are of two kinds,
some `text` and some `messages`, is refused rather than read as one):

- `text`: tokenized with the tokenizer (bos if it adds one, eos appended); loss on every token.
- `messages` (list of {role, content}): rendered with the tokenizer's chat template; loss only
  on the assistant turns' tokens (their content and end-of-turn marker, not the role header).
- `input_ids` (pre-tokenized), optional `labels` (HF convention: aligned, -100 ignored, not
  yet shifted) and optional `attention_mask` (positions with 0 are dropped as padding).

The formats other tools read map onto those three:

- `prompt` + `completion` (TRL's prompt-completion): strings become an `input_ids` + `labels` document,
  the prompt tokenized as a text (bos if the tokenizer adds one), the completion after it with eos, loss on
  the completion only (prompt and completion are tokenized apart, as TRL does, so the loss boundary falls
  exactly between them); lists of {role, content} become `messages` with the loss on the completion's
  assistant turns only.
- Alpaca, `instruction` + `output` (optional `input`, `system`): `messages` [system], user =
  instruction and input joined by a newline (LLaMA-Factory's mapping), assistant = output.
- ShareGPT, `conversations` of {from, value} (optional `system`): `messages`, with from human -> user,
  gpt -> assistant, system -> system (and user/assistant as they are).

Each record becomes one document stored as `input_ids` and `shift_labels` (int32), where
`shift_labels[t] = label[t + 1]` and the document's last token gets -100: labels are shifted
once on the full document, so the loss never predicts the next document's first token and any
later slicing (truncation, packing, sequence-parallel sharding) keeps every target
(ALST paper, Sec. 4.3). A few per-document statistics ride along for the summary and layout.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from lstune.data.batch import IGNORE_INDEX
from lstune.data.templates import render
from lstune.errors import DataError

IGNORE = IGNORE_INDEX  # the name data's modules use
KIND_FIELDS = {
    "text": ("text",),
    "messages": ("messages",),
    "input_ids": ("input_ids",),
    "prompt_completion": ("prompt", "completion"),
    "alpaca": ("instruction", "output"),
    "sharegpt": ("conversations",),
}
OPTIONAL_FIELDS = {"input_ids": ("labels", "attention_mask"), "alpaca": ("input", "system"), "sharegpt": ("system",)}
CHAT_KINDS = ("messages", "alpaca", "sharegpt")  # rendered with the chat template
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}


@dataclass(frozen=True)
class RecordKind:
    name: str  # a key of KIND_FIELDS
    fields: tuple[str, ...]  # the columns read, in the summary as "fields used"


def detect_kind(columns: Sequence[str]) -> RecordKind:
    """The record kind of a dataset with these columns; DataError listing them if none fits."""
    for name, required in KIND_FIELDS.items():
        if all(c in columns for c in required):
            optional = tuple(c for c in OPTIONAL_FIELDS.get(name, ()) if c in columns)
            return RecordKind(name, required + optional)
    raise DataError(
        f"the records have columns {sorted(columns)} but none lstune can train on. Give each record a "
        "'text' field (plain text), a 'messages' field (list of {role, content} chat turns), "
        "'input_ids' (pre-tokenized, with optional 'labels'), 'prompt' + 'completion', Alpaca's 'instruction' + "
        "'output' (+ 'input'), or ShareGPT's 'conversations' ({from, value} turns); a column of another name "
        "maps with --data-fields (e.g. --data-fields text=body)."
    )


def check_one_kind(records: Any, kind: RecordKind, source: str) -> None:
    """DataError when some records of `source` (a `datasets.Dataset`) are of another kind than `kind`.

    A JSON file whose rows mix kinds (some `text`, some `messages`) loads as one table with every column,
    null where a row lacks it; read as `kind`, the other rows would be empty documents, skipped as
    "no trainable token" without a word about why. Reads only the columns' null masks.
    """
    from functools import reduce

    import pyarrow.compute as pc

    required = KIND_FIELDS[kind.name]
    others = {name: fields for name, fields in KIND_FIELDS.items()
              if name != kind.name and all(c in records.column_names for c in fields)}
    if not others:
        return
    table = records.select_columns(sorted({c for f in (required, *others.values()) for c in f})).with_format("arrow")[:]
    lacking = reduce(pc.or_, [pc.is_null(table.column(c)) for c in required])
    for name, fields in others.items():
        other = pc.and_(lacking, reduce(pc.and_, [pc.is_valid(table.column(c)) for c in fields]))
        count = pc.sum(other).as_py() or 0
        if count:
            have = len(table) - (pc.sum(lacking).as_py() or 0)
            raise DataError(
                f"data source {source} mixes two kinds of records: {have} with {_field_names(required)} "
                f"({kind.name}) and {count} with {_field_names(fields)} ({name}) instead, e.g. record "
                f"{pc.index(other, True).as_py()}; lstune reads one kind per source, and would skip the {name} "
                "records. Put each kind in a file of its own and give both (--data a.jsonl --data b.jsonl), or "
                "convert the records to one kind."
            )


def _field_names(fields: Sequence[str]) -> str:
    return " + ".join(repr(f) for f in fields)


def check_tokenizer(kind: RecordKind, tokenizer: Any) -> None:
    """Fail before tokenizing anything if `tokenizer` cannot handle this kind."""
    if kind.name in CHAT_KINDS and not getattr(tokenizer, "chat_template", None):
        raise DataError(_no_template_message(f"chat records ({', '.join(repr(f) for f in kind.fields)})"))


def _no_template_message(what: str) -> str:
    return (f"the records are {what} but the tokenizer has no chat template. Give one with --chat-template "
            "(a Jinja file, or chatml / llama3), use a model whose tokenizer has one (an instruct/chat model), or "
            "give the records a 'text' field with the conversation already rendered.")


def tokenize_batch(batch: Mapping[str, list], indices: list[int], *, kind: str, tokenizer: Any) -> dict:
    """`datasets.map(batched=True, with_indices=True)` function: records -> documents (see DOC_COLUMNS)."""
    if kind == "text":
        docs = _text_documents(batch["text"], tokenizer)
    elif kind == "input_ids":
        docs = [_pretokenized_document(batch, row, i) for row, i in enumerate(indices)]
    elif kind == "prompt_completion":
        docs = _prompt_completion_documents(batch["prompt"], batch["completion"], indices, tokenizer)
    else:
        to_messages = {"messages": _messages, "alpaca": _alpaca_messages, "sharegpt": _sharegpt_messages}[kind]
        docs = [_chat_document(to_messages(batch, row, i), tokenizer, i) for row, i in enumerate(indices)]
    return _document_columns(docs)


def document_features():
    """Arrow schema of the tokenized documents (int32 tokens halve the cache of int64)."""
    from datasets import Features, List, Value

    return Features({
        "input_ids": List(Value("int32")),
        "shift_labels": List(Value("int32")),
        "length": Value("int64"),  # tokens in the document
        "n_targets": Value("int64"),  # labels != -100
        "first_target": Value("int64"),  # position of the first label != -100 (length if none)
        "last_target": Value("int64"),  # position of the last label != -100 (-1 if none)
        "max_id": Value("int64"),  # largest token id, to check against the model's vocabulary
    })


def shift_labels(labels_T: np.ndarray) -> np.ndarray:
    """`out[t] = labels[t + 1]`, and -100 at the last position (no target after a document)."""
    out_T = np.full_like(labels_T, IGNORE)
    out_T[:-1] = labels_T[1:]
    return out_T


def _document_columns(docs: list[tuple[np.ndarray, np.ndarray]]) -> dict:
    columns: dict[str, list] = {name: [] for name in document_features()}
    for ids_T, labels_T in docs:
        shifted_T = shift_labels(labels_T)
        target_T = shifted_T != IGNORE
        columns["input_ids"].append(ids_T.astype(np.int32))
        columns["shift_labels"].append(shifted_T.astype(np.int32))
        columns["length"].append(len(ids_T))
        columns["n_targets"].append(int(target_T.sum()))
        columns["first_target"].append(int(target_T.argmax()) if target_T.any() else len(ids_T))
        columns["last_target"].append(int(len(ids_T) - 1 - target_T[::-1].argmax()) if target_T.any() else -1)
        # Ids and targets both index the vocabulary (embedding rows, logit columns).
        columns["max_id"].append(int(max(ids_T.max(), labels_T.max())) if len(ids_T) else -1)
    return columns


def _text_documents(texts: list, tokenizer: Any) -> list[tuple[np.ndarray, np.ndarray]]:
    """Batch-encode (fast tokenizers do it in parallel in Rust); empty texts give empty documents."""
    for i, t in enumerate(texts):
        if t is not None and not isinstance(t, str):
            raise DataError(f"the 'text' field holds {type(t).__name__} values (e.g. {str(t)[:40]!r}), not strings; "
                            "give each record its text as one string.")
    present = [i for i, t in enumerate(texts) if isinstance(t, str) and t]
    encoded = []
    if present:  # `verbose=False`: long documents are the point here, not a mistake to warn about
        encoded = tokenizer([texts[i] for i in present], add_special_tokens=True, verbose=False)["input_ids"]
    eos = tokenizer.eos_token_id
    docs = [(np.zeros(0, np.int64), np.zeros(0, np.int64))] * len(texts)
    for i, ids in zip(present, encoded):
        if eos is not None and (not ids or ids[-1] != eos):
            ids = [*ids, eos]
        ids_T = np.asarray(ids, dtype=np.int64)
        docs[i] = (ids_T, ids_T)
    return docs


def _int_array(value: Any, column: str, index: int) -> np.ndarray:
    """`value` as int64 token ids; DataError for anything but whole numbers: a float column (Parquet's double, JSON's
    1.5) would otherwise be truncated to other ids silently, and a bool column read as ids 0 and 1."""
    try:
        found = np.asarray(value)
        if found.dtype.kind in "fcb" or (found.dtype == object and any(isinstance(v, (float, bool)) for v in
                                                                       found.reshape(-1).tolist())):
            raise TypeError
        return np.asarray(found, dtype=np.int64).reshape(-1)
    except (TypeError, ValueError, OverflowError):
        raise DataError(f"record {index}: '{column}' must be a list of whole numbers (token ids), not "
                        f"{_element_type(value)} values like {str(value)[:40]!r}.") from None


def _element_type(value: Any) -> str:
    """The type of a column's non-integer elements, for the message ('float' for Parquet's doubles)."""
    items = value.tolist() if hasattr(value, "tolist") else value
    if isinstance(items, (list, tuple)):
        odd = [v for v in items if isinstance(v, bool) or not isinstance(v, int)]
        if odd:
            return type(odd[0]).__name__
    return type(value).__name__


def _pretokenized_document(batch: Mapping[str, list], row: int, index: int) -> tuple[np.ndarray, np.ndarray]:
    ids_T = _int_array(batch["input_ids"][row], "input_ids", index)
    labels = batch["labels"][row] if "labels" in batch else None
    labels_T = ids_T if labels is None else _int_array(labels, "labels", index)
    if (ids_T < 0).any():
        raise DataError(f"record {index}: input_ids has the negative id {int(ids_T.min())}; token ids are 0 or more.")
    if ((labels_T < 0) & (labels_T != IGNORE)).any():
        bad = int(labels_T[(labels_T < 0) & (labels_T != IGNORE)][0])
        raise DataError(f"record {index}: labels has {bad}; a label is a token id (0 or more) or -100 (ignored).")
    mask = batch["attention_mask"][row] if "attention_mask" in batch else None
    keep_T = np.ones(len(ids_T), bool) if mask is None else np.asarray(mask).reshape(-1) != 0
    if not (len(labels_T) == len(ids_T) == len(keep_T)):
        raise DataError(
            f"record {index}: input_ids has {len(ids_T)} tokens but labels/attention_mask have "
            f"{len(labels_T)}/{len(keep_T)}. They must be aligned token for token (labels not yet shifted)."
        )
    return ids_T[keep_T], labels_T[keep_T]


def _messages(batch: Mapping[str, list], row: int, index: int) -> Any:
    return batch["messages"][row]


def _alpaca_messages(batch: Mapping[str, list], row: int, index: int) -> list[dict]:
    instruction, output = batch["instruction"][row], batch["output"][row]
    extra = batch["input"][row] if "input" in batch else None
    system = batch["system"][row] if "system" in batch else None
    for name, value in (("instruction", instruction), ("output", output), ("input", extra), ("system", system)):
        if value is not None and not isinstance(value, str):
            raise DataError(f"record {index}: Alpaca's '{name}' must be a string, not {type(value).__name__}.")
    if instruction is None or output is None:
        raise DataError(f"record {index}: Alpaca records need 'instruction' and 'output' strings.")
    messages = [{"role": "system", "content": system}] if system else []
    user = instruction + "\n" + extra if extra else instruction
    return messages + [{"role": "user", "content": user}, {"role": "assistant", "content": output}]


def _sharegpt_messages(batch: Mapping[str, list], row: int, index: int) -> list[dict]:
    turns = batch["conversations"][row]
    if not isinstance(turns, list) or not all(isinstance(t, Mapping) and "from" in t and "value" in t for t in turns):
        raise DataError(f"record {index}: ShareGPT 'conversations' must be a list of {{from, value}} objects.")
    system = batch["system"][row] if "system" in batch else None
    messages = [{"role": "system", "content": system}] if system else []
    for turn in turns:
        role = SHAREGPT_ROLES.get(turn["from"])
        if role is None:
            raise DataError(
                f"record {index}: a ShareGPT turn is from {turn['from']!r}; lstune maps "
                f"{', '.join(SHAREGPT_ROLES)}. Rename that speaker, or convert the records to 'messages'."
            )
        messages.append({"role": role, "content": turn["value"]})
    return messages


def _prompt_completion_documents(
    prompts: list, completions: list, indices: list[int], tokenizer: Any
) -> list[tuple[np.ndarray, np.ndarray]]:
    docs: list = [None] * len(prompts)
    plain = []
    for row, (prompt, completion, index) in enumerate(zip(prompts, completions, indices)):
        if isinstance(prompt, str) and isinstance(completion, str):
            plain.append(row)
        elif isinstance(prompt, list) and isinstance(completion, list):
            if not getattr(tokenizer, "chat_template", None):
                raise DataError(_no_template_message("conversational 'prompt' + 'completion' (lists of messages)"))
            docs[row] = _chat_document(prompt + completion, tokenizer, index, first_trained=len(prompt))
        else:
            raise DataError(
                f"record {index}: 'prompt' and 'completion' must both be strings, or both lists of {{role, "
                f"content}} messages; got {type(prompt).__name__} and {type(completion).__name__}."
            )
    if plain:
        prompt_ids = tokenizer([prompts[r] for r in plain], add_special_tokens=True, verbose=False)["input_ids"]
        completion_ids = tokenizer([completions[r] for r in plain], add_special_tokens=False, verbose=False)["input_ids"]
        eos = tokenizer.eos_token_id
        for row, p_ids, c_ids in zip(plain, prompt_ids, completion_ids):
            if eos is not None and (not c_ids or c_ids[-1] != eos):
                c_ids = [*c_ids, eos]
            ids_T = np.asarray([*p_ids, *c_ids], dtype=np.int64)
            labels_T = ids_T.copy()
            labels_T[: len(p_ids)] = IGNORE
            docs[row] = (ids_T, labels_T)
    return docs


def _chat_document(
    messages: Any, tokenizer: Any, index: int, first_trained: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """Ids of the rendered conversation and labels that keep only the assistant turns.

    HF's `return_assistant_tokens_mask` needs `{% generation %}` markers that most templates
    lack, so the spans are found generically: assistant turn i starts where rendering
    messages[:i] with the generation prompt ends, and ends where rendering messages[:i+1] ends.
    Both renderings must be token prefixes of the whole conversation (prefix stability);
    templates that rewrite earlier turns (e.g. strip past reasoning) are refused. Cost: 1 + 2 x
    (assistant turns) renderings per conversation. Only turns from `first_trained` on are trained
    (a prompt's own assistant turns are context).
    """
    if not isinstance(messages, list) or not all(isinstance(m, Mapping) and "role" in m for m in messages):
        raise DataError(f"record {index}: 'messages' must be a list of {{role, content}} objects.")
    _check_contents(tokenizer, messages, index)
    ids_T = _render(tokenizer, messages, False, index)
    labels_T = np.full_like(ids_T, IGNORE)
    for turn, message in enumerate(messages):
        if message["role"] != "assistant" or turn < first_trained:
            continue
        start = _prefix_length(tokenizer, messages[:turn], True, ids_T, index)
        end = _prefix_length(tokenizer, messages[: turn + 1], False, ids_T, index)
        labels_T[start:end] = ids_T[start:end]
    return ids_T, labels_T


def _check_contents(tokenizer: Any, messages: list, index: int) -> None:
    """DataError for a turn whose content is not text, unless the template renders it as what it means.

    A null content is accepted only on a turn with `tool_calls`, and only when the template renders those (the
    rendering changes without them) and renders the null as nothing (as "" renders); otherwise the turn would
    be trained as an empty answer, its tool call lost, or as the text "None" (Jinja's text of None). A list
    (content parts) is accepted only when the template reads the parts (their Python text, which Jinja prints
    for a template that does not, is not in the rendering). Costs a few extra renderings, only for such records.
    """
    odd = [(turn, m) for turn, m in enumerate(messages) if not isinstance(m.get("content"), str)]
    for turn, m in odd:
        content = m.get("content")
        if content is None and not m.get("tool_calls"):
            raise DataError(f"record {index}: message {turn} ({m['role']}) has no content (null) and no tool_calls; "
                            "lstune trains on the text of each turn. Give it a string (\"\" for an empty turn), or "
                            "remove the turn or the record.")
        if content is not None and not isinstance(content, list):
            raise DataError(f"record {index}: message {turn} ({m['role']}) has content of type "
                            f"{type(content).__name__}; give each turn its text as a string.")
    rendered = _render_text(tokenizer, messages, index) if odd else ""
    for turn, m in odd:
        if m.get("content") is not None:
            if str(m["content"]) in rendered:
                raise DataError(_not_rendered(index, turn, m, "prints the list as its Python text"))
            continue
        without_calls = {k: v for k, v in m.items() if k != "tool_calls"}
        if _render_text(tokenizer, _with_turn(messages, turn, without_calls), index, probe=True) == rendered:
            raise DataError(_not_rendered(index, turn, m, "ignores tool_calls, so it would be trained as an empty "
                                                          "answer"))
        as_empty = _render_text(tokenizer, _with_turn(messages, turn, {**m, "content": ""}), index, probe=True)
        if as_empty is not None and as_empty != rendered:
            raise DataError(_not_rendered(index, turn, m, "prints the null content as the text 'None'"))


def _with_turn(messages: list, turn: int, message: Mapping) -> list:
    return [*messages[:turn], message, *messages[turn + 1 :]]


def _not_rendered(index: int, turn: int, message: Mapping, how: str) -> str:
    what = "no content (null)" if message.get("content") is None else "a list as content"
    return (f"record {index}: message {turn} ({message['role']}) has {what}, and the chat template {how}. Give the "
            "turn its text as a string, or use a chat template that renders such turns (tool calls, content parts).")


def _render_text(tokenizer: Any, messages: list, index: int, *, probe: bool = False) -> str | None:
    """The rendered text; for a `probe` (a variant of the record, not the record), None if the template fails."""
    try:
        return render(tokenizer, messages, index, "Fix the record (roles, order, contents) or use a template that "
                      "accepts it.", tokenize=False,
                      add_generation_prompt=False)
    except DataError:
        if probe:
            return None
        raise


def _prefix_length(
    tokenizer: Any, messages: list, generation_prompt: bool, full_T: np.ndarray, index: int
) -> int:
    prefix_T = _render(tokenizer, messages, generation_prompt, index)
    if len(prefix_T) > len(full_T) or not np.array_equal(prefix_T, full_T[: len(prefix_T)]):
        raise DataError(
            f"record {index}: the tokenizer's chat template is not prefix-stable (rendering the first "
            f"{len(messages)} messages{' with the generation prompt' if generation_prompt else ''} is not a "
            "prefix of the whole conversation), so the assistant tokens cannot be located. Use a template "
            "that renders earlier turns unchanged, or pre-tokenize the data as input_ids + labels."
        )
    return len(prefix_T)


def _render(tokenizer: Any, messages: list, generation_prompt: bool, index: int) -> np.ndarray:
    ids = render(
        tokenizer, messages, index, "Fix the record (roles, order) or use a template that accepts it.",
        tokenize=True, add_generation_prompt=generation_prompt,
        tokenizer_kwargs={"verbose": False},  # long conversations are intended: no length warning
    )
    if isinstance(ids, Mapping):  # transformers 5 returns a BatchEncoding by default
        ids = ids["input_ids"]
    return np.asarray(ids, dtype=np.int64).reshape(-1)
