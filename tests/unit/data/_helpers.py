"""Helpers shared by the data-layer tests: a real HF tokenizer built offline, file writers."""

from __future__ import annotations

import json
from pathlib import Path

WORDS = "hello world how are you fine thanks the pass key is what a b c d e f g h".split()
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }} {{ m['content'] }} <|im_end|> {% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant {% endif %}"
)


def make_word_tokenizer(chat_template: str | None = CHATML, *, adds_eos: bool = False):
    """A real `PreTrainedTokenizerFast` (word-level, adds bos like Llama, eos too if asked), built offline."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<s>", "</s>", "<unk>", "<|im_start|>", "<|im_end|>"]
    vocab = {t: i for i, t in enumerate(specials + WORDS + ["user", "assistant", "system"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>" if adds_eos else "<s> $A",
        special_tokens=[("<s>", vocab["<s>"]), ("</s>", vocab["</s>"])],
    )
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )
    hf.chat_template = chat_template
    return hf


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path
