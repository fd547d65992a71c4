from __future__ import annotations

import json

from lstune.data.synthetic import (
    BUNDLED_CHARS,
    BUNDLED_PASSKEY,
    BUNDLED_RECORDS,
    BUNDLED_SEED,
    QUESTION,
    passkey_records,
)


def test_passkey_records_state_the_key_once_then_ask_and_answer():
    for record in passkey_records(8, 2000, seed=7):
        key, text = record["passkey"], record["text"]
        assert len(key) == 5 and key.isdigit()
        assert text.endswith(f"{QUESTION}The pass key is {key}.")
        body = text[: -len(QUESTION) - len(f"The pass key is {key}.")]
        assert body.count(f"The pass key is {key}. Remember it.") == 1
        assert 1800 <= len(text) <= 2000
        assert 0 <= record["depth"] <= 1


def test_same_seed_same_records_other_seed_other_keys():
    assert passkey_records(4, 1000, seed=1) == passkey_records(4, 1000, seed=1)
    keys = lambda seed: [r["passkey"] for r in passkey_records(4, 1000, seed)]  # noqa: E731
    assert keys(1) != keys(2)


def test_key_depth_varies():
    assert len({r["depth"] for r in passkey_records(16, 3000, seed=0)}) > 4


def test_bundled_file_is_what_the_function_generates_and_small():
    records = [json.loads(line) for line in BUNDLED_PASSKEY.read_text().splitlines()]
    assert records == passkey_records(BUNDLED_RECORDS, BUNDLED_CHARS, BUNDLED_SEED)
    assert BUNDLED_PASSKEY.stat().st_size < 300_000


def test_answer_records_split_the_text_before_the_key_and_held_out_keys_are_unseen():
    from lstune.data.synthetic import answer_record, heldout_records

    for record in passkey_records(4, 2000, seed=3):
        answer = answer_record(record)
        assert answer["prompt"] + answer["completion"] == record["text"]
        assert answer["prompt"].endswith(f"{QUESTION}The pass key is ") and answer["completion"] == record["passkey"] + "."
    bundled = {r["passkey"] for r in passkey_records(BUNDLED_RECORDS, BUNDLED_CHARS, BUNDLED_SEED)}
    held = heldout_records()
    assert len(held) == 16 and not bundled & {r["passkey"] for r in held}
