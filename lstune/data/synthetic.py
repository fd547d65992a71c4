"""Synthetic long-context tasks for demos and tests: passkey retrieval.

The passkey task (Mohtashami & Jaggi, "Landmark Attention", 2023; used by LongLoRA and others
to probe long-context fine-tuning): a 5-digit key is stated once at a random depth inside
repeated filler sentences, and the text ends with the question and the answer. The filler is
perfectly predictable, so even a tiny model's loss falls within a few dozen steps; retrieving
the key needs attention across the whole sample, which is what long-context training is for.

Three built-in data sources (`lstune.data.sources`) come from it:
- `builtin:passkey`: the bundled records as text, loss on every token (mostly filler);
- `builtin:passkey-answer`: the same records as prompt + completion, loss on the key only;
- `builtin:passkey-eval`: other records (other seed, unseen keys) as prompt + completion: held-out samples
  on which validation reports passkey accuracy (each sample's labels are its answer).

`python -m lstune.data.synthetic` regenerates the bundled `bundled/passkey.jsonl` that
`--data builtin:passkey` reads.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

INTRO = (
    "There is an important piece of information hidden inside a lot of irrelevant text. "
    "Find it and memorize it. I will quiz you about it.\n"
)
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
QUESTION = "\nWhat is the pass key? "

BUNDLED_PASSKEY = Path(__file__).with_name("bundled") / "passkey.jsonl"
BUNDLED_RECORDS, BUNDLED_CHARS, BUNDLED_SEED = 64, 3500, 0
HELDOUT_RECORDS, HELDOUT_SEED = 16, 1
# Sources whose labels are exactly the passkey (validation on them reports passkey accuracy).
ANSWER_SOURCES = ("builtin:passkey-answer", "builtin:passkey-eval")


def passkey_records(n: int, n_chars: int, seed: int) -> list[dict]:
    """`n` passkey records of about `n_chars` characters each (at least one filler block).

    Each record: `text` (intro, filler with the key sentence at a random depth, question,
    answer "The pass key is 71432."), `passkey` (the 5 digits) and `depth` (0..1, where in the
    filler the key sits). Same arguments -> same records.
    """
    rng = random.Random(seed)
    return [_passkey_record(rng, n_chars) for _ in range(n)]


def _passkey_record(rng: random.Random, n_chars: int) -> dict:
    key = rng.randint(10000, 99999)
    needle = f"The pass key is {key}. Remember it. {key} is the pass key. "
    answer = f"The pass key is {key}."
    fixed = len(INTRO) + len(needle) + len(QUESTION) + len(answer)
    n_fill = max(1, (n_chars - fixed) // len(FILLER))
    depth = rng.randint(0, n_fill)
    text = INTRO + FILLER * depth + needle + FILLER * (n_fill - depth) + QUESTION + answer
    return {"text": text, "passkey": str(key), "depth": round(depth / n_fill, 3)}


def answer_record(record: dict) -> dict:
    """`record` as prompt + completion: the prompt is its text up to "The pass key is ", the completion the key and
    its full stop (tokenized after the prompt with eos: the text's own tokens, of which only these carry a loss)."""
    answer = f"{record['passkey']}."
    assert record["text"].endswith(answer), "not a passkey record"
    return {"prompt": record["text"][: -len(answer)], "completion": answer,
            "passkey": record["passkey"], "depth": record["depth"]}


def heldout_records() -> list[dict]:
    """`builtin:passkey-eval`: answer records of the bundled length under another seed (keys the bundled set lacks)."""
    return [answer_record(r) for r in passkey_records(HELDOUT_RECORDS, BUNDLED_CHARS, HELDOUT_SEED)]


def write_jsonl(records: list[dict], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for record in records:
            f.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    write_jsonl(passkey_records(BUNDLED_RECORDS, BUNDLED_CHARS, BUNDLED_SEED), BUNDLED_PASSKEY)
    print(f"wrote {BUNDLED_PASSKEY} ({BUNDLED_PASSKEY.stat().st_size} bytes)")
