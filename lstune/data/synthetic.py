"""Synthetic long-context tasks for demos and tests: passkey retrieval.

The passkey task (Mohtashami & Jaggi, "Landmark Attention", 2023; used by LongLoRA and others
to probe long-context fine-tuning): a 5-digit key is stated once at a random depth inside
repeated filler sentences, and the text ends with the question and the answer. The filler is
perfectly predictable, so even a tiny model's loss falls within a few dozen steps; retrieving
the key needs attention across the whole sample, which is what long-context training is for.

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


def write_jsonl(records: list[dict], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for record in records:
            f.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    write_jsonl(passkey_records(BUNDLED_RECORDS, BUNDLED_CHARS, BUNDLED_SEED), BUNDLED_PASSKEY)
    print(f"wrote {BUNDLED_PASSKEY} ({BUNDLED_PASSKEY.stat().st_size} bytes)")
