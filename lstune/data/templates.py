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

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from lstune.errors import DataError

# How long one rendering of one conversation may take. A template is a program (Jinja, sandboxed: it runs no code of
# the host, but its loops are unbounded: two nested loops over range(100000) render for hours); a real template
# renders a conversation in milliseconds, its length being string joins.
RENDER_SECONDS = 30.0
# A plain conversation to tell a broken template from a record it rejects.
_PLAIN = [{"role": "user", "content": "Hello."}, {"role": "assistant", "content": "Hello! How can I help?"}]

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
    try:
        tokenizer.lstune_chat_template = value  # named in messages about the template (`template_name`)
    except AttributeError:
        pass
    return f"chat template: {value} (--chat-template)"


class TemplateTimeout(Exception):
    """A chat template rendered past RENDER_SECONDS."""


@contextmanager
def render_time_limit(seconds: float | None = None) -> Iterator[None]:
    """Raise TemplateTimeout in the block past `seconds` (RENDER_SECONDS by default; SIGALRM, so the main thread
    only, where Python runs signal handlers: elsewhere the block runs unbounded). The signal interrupts Jinja's
    Python loops."""
    seconds = RENDER_SECONDS if seconds is None else seconds
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        yield
        return

    def expired(signum, frame):
        raise TemplateTimeout(f"it rendered for more than {seconds:g} s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def template_name(tokenizer: Any) -> str:
    """How messages name the chat template in use: the --chat-template given, or the tokenizer's own."""
    value = getattr(tokenizer, "lstune_chat_template", None)
    return f"--chat-template {value!r}" if isinstance(value, str) else "the tokenizer's chat template"


def render(tokenizer: Any, messages: list, index: int, what: str, *, tokenize: bool, add_generation_prompt: bool,
           tokenizer_kwargs: dict | None = None) -> Any:
    """`messages` rendered with the tokenizer's chat template (ids, or the text when not `tokenize`), within
    RENDER_SECONDS and the size limit of `sandbox.render_bounded`. A failure is a DataError that blames the template
    when it also fails (or runs past a limit) on a plain two-turn conversation, else record `index` (`what`: what
    to fix in the record); past a limit, it names both."""
    try:
        with render_time_limit():
            return _apply(tokenizer, messages, tokenize, add_generation_prompt, tokenizer_kwargs)
    except Exception as exc:  # templates raise arbitrary errors (jinja raise_exception) on data they reject
        from lstune.data.sandbox import TemplateTooLarge

        if isinstance(exc, TemplateTooLarge):
            raise DataError(
                f"{template_name(tokenizer)} rendering record {index}: {exc} (the limit is "
                f"{_limit_words(messages)}); a chat template renders a conversation about once, so it is at fault "
                "(or the record is). Fix the template, or use another (--chat-template chatml, llama3 or a file)."
            ) from None
        if isinstance(exc, TemplateTimeout) or _fails_on_a_plain_conversation(tokenizer):
            raise DataError(
                f"{template_name(tokenizer)} cannot render a conversation ({type(exc).__name__}: {exc}); it fails on a "
                "plain user/assistant exchange too, so the template is at fault, not record "
                f"{index}. Fix the template, or use another (--chat-template chatml, llama3 or a file)."
            ) from exc
        raise DataError(
            f"record {index}: {template_name(tokenizer)} failed on this conversation ({type(exc).__name__}: {exc}). "
            f"{what}"
        ) from exc


def _limit_words(messages: list) -> str:
    from lstune.data.sandbox import limit_words

    return limit_words(messages)


def _apply(tokenizer: Any, messages: list, tokenize: bool, add_generation_prompt: bool,
           tokenizer_kwargs: dict | None) -> Any:
    """As `tokenizer.apply_chat_template(messages, tokenize=..., add_generation_prompt=..., tokenizer_kwargs=...)`,
    rendered by lstune's bounded sandbox for a transformers tokenizer (others, lstune's byte tokenizer and test
    doubles, render their own way: the byte tokenizer's Jinja path is the same sandbox)."""
    template = _jinja_template(tokenizer)
    if template is None:
        return tokenizer.apply_chat_template(messages, tokenize=tokenize, add_generation_prompt=add_generation_prompt,
                                             tokenizer_kwargs=tokenizer_kwargs)
    from lstune.data.sandbox import render_bounded

    text = render_bounded(template, messages, tokenizer.special_tokens_map, add_generation_prompt)
    if not tokenize:
        return text
    # As apply_chat_template tokenizes its rendering: no special tokens added (the template writes them).
    return tokenizer(text, add_special_tokens=False, **(tokenizer_kwargs or {}))["input_ids"]


def _jinja_template(tokenizer: Any) -> str | None:
    """The Jinja text transformers would render for a transformers tokenizer (its `get_chat_template`), else None."""
    from transformers import PreTrainedTokenizerBase

    if not isinstance(tokenizer, PreTrainedTokenizerBase):
        return None
    return tokenizer.get_chat_template()


def _fails_on_a_plain_conversation(tokenizer: Any) -> bool:
    try:
        with render_time_limit():
            _apply(tokenizer, _PLAIN, False, False, None)
    except Exception:  # noqa: BLE001 - any failure on the plain conversation is the template's
        return True
    return False
