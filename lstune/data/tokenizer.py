"""A byte-level tokenizer, so tiny presets and demos run with no tokenizer download.

Ids: pad 0, bos 1, eos 2, and byte `b` -> `b + 3` (vocab 259; the tiny presets have vocab 320,
so every id fits). It exposes the subset of the Hugging Face tokenizer surface that lstune uses
(`encode`, `__call__`, `decode`, special-token ids, `chat_template` + `apply_chat_template`,
`save_pretrained` / `from_pretrained`), so the data layer treats it like any HF tokenizer.

Written by hand rather than with the `tokenizers` library because a byte map needs no trained
vocabulary, and encoding a few GB of text is one numpy add instead of a per-character loop.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from lstune.errors import ModelError, UserError
from lstune.untrusted import describe, parser_errors

logger = logging.getLogger("lstune")


class ByteTokenizer:
    """UTF-8 bytes as tokens, plus pad/bos/eos; a built-in chat format for chat data."""

    CONFIG_NAME = "lstune_tokenizer.json"

    pad_token_id = 0
    bos_token_id = 1
    eos_token_id = 2
    byte_offset = 3
    vocab_size = 256 + byte_offset
    pad_token, bos_token, eos_token = "<pad>", "<s>", "</s>"
    name_or_path = "lstune/byte"

    # The built-in chat format (documentation of what `apply_chat_template` renders):
    # bos, then for each message the bytes of "<|role|>\n" and of its content, then eos; the
    # generation prompt is the bytes of "<|assistant|>\n". It is byte-exact, hence prefix-stable,
    # which the assistant-only loss relies on.
    chat_template = (
        "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}"
        "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
    )

    def __len__(self) -> int:
        return self.vocab_size

    def __repr__(self) -> str:
        return f"ByteTokenizer(vocab_size={self.vocab_size})"

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Ids of `text`'s UTF-8 bytes, after a bos when `add_special_tokens` (as Llama's tokenizer)."""
        return self._encode_np(text, add_special_tokens).tolist()

    def __call__(
        self, text: str | Sequence[str], *, add_special_tokens: bool = True, verbose: bool = True
    ) -> dict[str, list]:
        """HF-style call: `{"input_ids": ids}` for one text, or a list of id lists for a batch.

        `verbose` exists only so callers can pass the HF keyword; a byte tokenizer has no
        maximum length to warn about.
        """
        if isinstance(text, str):
            return {"input_ids": self.encode(text, add_special_tokens)}
        return {"input_ids": [self.encode(t, add_special_tokens) for t in text]}

    def decode(self, ids: Sequence[int] | np.ndarray, skip_special_tokens: bool = False) -> str:
        """Text of `ids`; special ids render as <pad>/<s>/</s> unless skipped, invalid UTF-8 as U+FFFD."""
        specials = {
            self.pad_token_id: self.pad_token,
            self.bos_token_id: self.bos_token,
            self.eos_token_id: self.eos_token,
        }
        parts: list[str] = []
        run = bytearray()
        for i in np.asarray(ids, dtype=np.int64).tolist():
            if i >= self.byte_offset:
                run.append(i - self.byte_offset)
                continue
            parts.append(run.decode("utf-8", errors="replace"))
            run.clear()
            if not skip_special_tokens:
                parts.append(specials.get(i, ""))
        parts.append(run.decode("utf-8", errors="replace"))
        return "".join(parts)

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, str]],
        tokenize: bool = True,
        add_generation_prompt: bool = False,
        **_hf_only_options,
    ) -> list[int] | str:
        """The built-in chat format (see `chat_template`): ids, or their text when `tokenize=False`.

        HF-only options (tools, return_dict, ...) are accepted and have no effect here. A template set on the
        instance (`--chat-template`) is rendered with transformers' Jinja renderer instead, its special-token
        strings (<s>, </s>, <pad>) becoming their ids. The built-in format renders text only: a content that is
        not a string (null, as tool-call turns have, or a list of parts) is a ValueError, not Python's text of it.
        """
        if self.chat_template != type(self).chat_template:
            return self._apply_custom_template(messages, tokenize, add_generation_prompt)
        pieces = [np.array([self.bos_token_id], dtype=np.int64)]
        for turn, message in enumerate(messages):
            text = message.get("content")
            if not isinstance(text, str):
                raise ValueError(
                    f"message {turn} ({message['role']}) has content {'null' if text is None else type(text).__name__}"
                    "; lstune's byte-level chat format renders text only, so give every turn a string"
                )
            header = self._encode_np(f"<|{message['role']}|>\n", add_special_tokens=False)
            content = self._encode_np(text, add_special_tokens=False)
            pieces += [header, content, np.array([self.eos_token_id], dtype=np.int64)]
        if add_generation_prompt:
            pieces.append(self._encode_np("<|assistant|>\n", add_special_tokens=False))
        ids = np.concatenate(pieces).tolist()
        return ids if tokenize else self.decode(ids)

    def _apply_custom_template(self, messages, tokenize: bool, add_generation_prompt: bool) -> list[int] | str:
        from lstune.data.sandbox import render_bounded

        # Rendered as transformers renders it (keys whose value is None dropped, ...), with bounded memory.
        rendered = render_bounded(
            self.chat_template, list(messages),
            {"bos_token": self.bos_token, "eos_token": self.eos_token, "pad_token": self.pad_token},
            add_generation_prompt,
        )
        if not tokenize:
            return rendered
        specials = {self.bos_token: self.bos_token_id, self.eos_token: self.eos_token_id, self.pad_token: self.pad_token_id}
        pieces = re.split("(" + "|".join(re.escape(s) for s in specials) + ")", rendered)
        ids = [[specials[p]] if p in specials else self.encode(p, add_special_tokens=False) for p in pieces if p]
        return [i for piece in ids for i in piece]

    def save_pretrained(self, save_directory: str | Path) -> tuple[str]:
        """Write `lstune_tokenizer.json` so a saved model folder records which tokenizer it uses."""
        directory = Path(save_directory)
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / self.CONFIG_NAME
        config = {
            "tokenizer_class": type(self).__name__,
            "vocab_size": self.vocab_size,
            "pad_token_id": self.pad_token_id,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "byte_offset": self.byte_offset,
        }
        path.write_text(json.dumps(config, indent=2) + "\n")
        self.as_hf().save_pretrained(str(directory))
        return (str(path),)

    def as_hf(self):
        """The same tokenizer as a transformers fast tokenizer, so a saved model folder loads with AutoTokenizer.

        Byte-level BPE with no merges: every UTF-8 byte is one token, id = byte + `byte_offset`, after a bos,
        exactly as `encode` does."""
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
        from transformers import PreTrainedTokenizerFast

        specials = [self.pad_token, self.bos_token, self.eos_token]
        byte_chars = pre_tokenizers.ByteLevel.alphabet()
        # ByteLevel's alphabet is a set; order it by the byte each character stands for.
        to_byte = {v: k for k, v in _bytes_to_unicode().items()}
        vocab = {token: i for i, token in enumerate(specials)}
        vocab.update({c: to_byte[c] + self.byte_offset for c in byte_chars})
        tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tok.decoder = decoders.ByteLevel()
        tok.post_processor = processors.TemplateProcessing(
            single=f"{self.bos_token} $A", pair=f"{self.bos_token} $A $B", special_tokens=[(self.bos_token, self.bos_token_id)],
        )
        tok.add_special_tokens(specials)
        return PreTrainedTokenizerFast(
            tokenizer_object=tok, pad_token=self.pad_token, bos_token=self.bos_token, eos_token=self.eos_token,
            chat_template=self.chat_template,
        )

    @classmethod
    def saved_in(cls, directory: str | Path) -> bool:
        """Whether `directory` holds a ByteTokenizer written by `save_pretrained`."""
        return (Path(directory) / cls.CONFIG_NAME).is_file()

    @classmethod
    def from_pretrained(cls, directory: str | Path) -> ByteTokenizer:
        """Load the tokenizer saved in `directory`; ModelError if there is none or it differs."""
        path = Path(directory) / cls.CONFIG_NAME
        if not path.is_file():
            raise ModelError(
                f"{directory} has no {cls.CONFIG_NAME}; it was not saved with lstune's byte tokenizer. "
                "Load its own tokenizer with transformers.AutoTokenizer instead."
            )
        from lstune.untrusted import read_json

        config = read_json(path, error=ModelError)
        if config.get("tokenizer_class") != cls.__name__ or config.get("byte_offset") != cls.byte_offset:
            raise ModelError(f"{path} describes {config.get('tokenizer_class')!r}, not this ByteTokenizer.")
        return cls()

    def _encode_np(self, text: str, add_special_tokens: bool) -> np.ndarray:
        ids = np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64) + self.byte_offset
        if add_special_tokens:
            ids = np.concatenate([np.array([self.bos_token_id], dtype=np.int64), ids])
        return ids


# Files that hold a Hugging Face tokenizer: a folder with any of them ships one.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "merges.txt",
                   "vocab.txt", "spiece.model")


def _tokenizer_files(location: str) -> list[str]:
    """The tokenizer files of a local model folder, each JSON one read as untrusted JSON first (ModelError naming
    it when it is not valid, or nested past the parser's recursion)."""
    from lstune.untrusted import read_json

    found = [name for name in TOKENIZER_FILES if (Path(location) / name).is_file()]
    for name in found:
        if name.endswith(".json"):
            read_json(Path(location) / name, error=ModelError, what="the tokenizer file")
    return found


def load_model_tokenizer(
    kind: str, location: str, *, name: str, vocab_size: int, trust_remote_code: bool = False
) -> tuple[object, list[str]]:
    """The tokenizer of a model (`kind` "preset" | "local" | "hub" at `location`, as the user called it
    `name`), or the byte-level fallback with a note saying so. Takes plain values, not the model layer's
    types, so the data layer imports nothing beside it."""
    notes: list[str] = []
    if kind == "local" and ByteTokenizer.saved_in(location):
        return ByteTokenizer.from_pretrained(location), notes  # a model lstune trained and saved
    if kind != "preset":
        from transformers import AutoTokenizer

        shipped = _tokenizer_files(location) if kind == "local" else []
        try:
            tokenizer = AutoTokenizer.from_pretrained(location, trust_remote_code=trust_remote_code)
        except (*parser_errors(), OSError, RecursionError) as exc:
            if kind != "local" or shipped:  # a folder's tokenizer files that do not load are not "no tokenizer"
                where = f" ({', '.join(shipped)} in {location})" if shipped else ""
                raise ModelError(f"--model {name!r}: its tokenizer{where} could not be loaded ({describe(exc)}); fix "
                                 "or replace those files.") from None
            logger.debug("no HF tokenizer in %s: %s", location, exc)
        else:
            if not is_empty_tokenizer(tokenizer):
                return tokenizer, notes
            notes.append("transformers built an empty tokenizer for this model (no tokenizer files: it encodes "
                         "text to no tokens)")
    tokenizer = ByteTokenizer()
    if vocab_size < tokenizer.vocab_size:
        raise UserError(
            f"--model {name!r} has no tokenizer and its vocabulary ({vocab_size}) is smaller "
            f"than the byte-level fallback's ({tokenizer.vocab_size}); give pre-tokenized data "
            "(records with input_ids) or a model folder with a tokenizer."
        )
    notes.append("no tokenizer shipped with this model: using lstune's byte-level tokenizer (1 token per byte)")
    return tokenizer, notes


def is_empty_tokenizer(tokenizer) -> bool:
    """transformers 5 builds a tokenizer with no vocabulary for a folder without tokenizer files (GPT-2 and Qwen2
    classes among others): it encodes any text to no ids."""
    try:
        return len(tokenizer) <= 1 or not tokenizer("lstune probe text", add_special_tokens=False)["input_ids"]
    except (TypeError, ValueError, KeyError):
        return False


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table, which the `tokenizers` ByteLevel pre-tokenizer uses."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, chars)))
