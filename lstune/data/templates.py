"""`--chat-template`: a chat template given by name (a few common, prefix-stable ones) or as a Jinja file.

The template replaces the tokenizer's own (`tokenizer.chat_template`) before any record is rendered; the data
layer then renders it like any template (assistant spans located by prefix renderings, see records.py), so a
template must render earlier turns unchanged. The named ones do:

- `chatml`: `<|im_start|>role\\ncontent<|im_end|>\\n` per message (Qwen, many others).
- `llama3`: bos, then `<|start_header_id|>role<|end_header_id|>\\n\\ncontent<|eot_id|>` per message.

Their markers are special tokens only in tokenizers that define them; elsewhere they are tokenized as text,
which trains fine but costs a few tokens per turn.
"""

from __future__ import annotations

from pathlib import Path

from lstune.errors import DataError

KNOWN_TEMPLATES = {
    "chatml": (
        "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
        "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    ),
    "llama3": (
        "{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + "
        "'<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
    ),
}


def check_chat_template(value: str | None) -> None:
    """DataError unless `value` is None, a known name or a readable file (cheap: before anything loads)."""
    if value is not None:
        read_chat_template(value)


def read_chat_template(value: str) -> str:
    """The Jinja text of a known template name or of a file."""
    if value.lower() in KNOWN_TEMPLATES:
        return KNOWN_TEMPLATES[value.lower()]
    path = Path(value).expanduser()
    if not path.is_file():
        from lstune.untrusted import path_kind

        what = path_kind(path)
        said = "is neither a known template" if what == "nothing" else f"is {what}, not a known template"
        raise DataError(f"--chat-template {value!r} {said} ({', '.join(KNOWN_TEMPLATES)}) nor a file; give one of "
                        "those names or the path of a Jinja chat template.")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise DataError(f"--chat-template {value!r} could not be read ({exc}); give a UTF-8 Jinja file.") from None
    if "messages" not in text:
        raise DataError(f"--chat-template {value!r} never reads `messages`, so it is not a chat template; give a Jinja "
                        "template that loops over messages (see a model's tokenizer_config.json).")
    return text


def set_chat_template(tokenizer, value: str | None) -> str | None:
    """Give `tokenizer` the template `value` names; a note for the run, or None when there is nothing to do."""
    if value is None:
        return None
    tokenizer.chat_template = read_chat_template(value)
    return f"chat template: {value} (--chat-template)"
