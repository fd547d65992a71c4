"""Parsers for config values given as flags (strings) or recipe values (YAML scalars).

Each parser returns the typed value or raises `ValueError` whose message completes the sentence
"<key> <value> ..." — the caller adds the key and collects every error before reporting.
"""

from __future__ import annotations

import math
import re
from typing import Any

_LENGTH_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kKmM]?)\s*$")
_BYTES_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kKmMgGtT]?)i?[bB]?\s*$")
_UNITS = {"": 1, "k": 1024, "m": 1024**2}
_BYTE_UNITS = {"": 1, "k": 1024, "m": 1024**2, "g": 1024**3, "t": 1024**4}

LENGTH_HINT = "use e.g. 32768, 32k, 500K, 1M, 1.5M"
INT64_MAX = 2**63 - 1  # every integer setting ends up in a torch/numpy int64 (seeds, counts, sizes)


def parse_length(value: Any) -> int:
    """Token counts: 32768, '32k' (= 32768), '500K', '1M' (= 1048576), '1.5M'. k = 1024, M = 1024²."""
    if isinstance(value, bool):
        raise ValueError(f"is not a length; {LENGTH_HINT}")
    if isinstance(value, int):
        n = value
    else:
        match = _LENGTH_RE.match(str(value))
        if not match:
            raise ValueError(f"is not a length; {LENGTH_HINT}")
        number, unit = float(match.group(1)), match.group(2).lower()
        n = number * _UNITS[unit]
        if n != int(n):
            raise ValueError(f"is not a whole number of tokens; {LENGTH_HINT}")
        n = int(n)
    if n < 2:
        raise ValueError("must be at least 2 tokens")
    if n > INT64_MAX:
        raise ValueError(f"is beyond any possible length (at most {INT64_MAX})")
    return n


def parse_bytes(value: Any) -> int:
    """Byte sizes: 1073741824, '64G', '64GiB', '512MB' (binary units)."""
    if isinstance(value, int) and not isinstance(value, bool):
        n = value
    else:
        match = _BYTES_RE.match(str(value))
        if not match:
            raise ValueError("is not a size; use e.g. 64G, 512M, 1T")
        n = int(float(match.group(1)) * _BYTE_UNITS[match.group(2).lower()])
    if n < 0:
        raise ValueError("must not be negative")
    if n > INT64_MAX:
        raise ValueError(f"is beyond any possible size (at most {INT64_MAX} bytes)")
    return n


def parse_int(value: Any, *, minimum: int | None = None, maximum: int = INT64_MAX) -> int:
    """A whole number in [minimum, maximum]; the default maximum is int64's, where torch and numpy stop."""
    if isinstance(value, bool) or isinstance(value, float):
        raise ValueError("is not a whole number")
    try:
        n = int(str(value).strip()) if not isinstance(value, int) else value
    except ValueError:
        raise ValueError("is not a whole number") from None
    if minimum is not None and n < minimum:
        raise ValueError(f"must be at least {minimum}")
    if n > maximum:
        raise ValueError(f"must be at most {maximum}")
    return n


def parse_float(
    value: Any,
    *,
    minimum: float | None = None,
    maximum: float | None = None,
    above: float | None = None,
    below: float | None = None,
) -> float:
    """A finite number within the bounds: `minimum`/`maximum` inclusive, `above`/`below` exclusive.

    NaN and infinity are refused for every setting: NaN compares false with every bound (so it would
    pass them) and both turn the weights into NaN or silently disable what the setting controls."""
    if isinstance(value, bool):
        raise ValueError("is not a number")
    try:
        x = float(value)
    except (TypeError, ValueError, OverflowError):
        raise ValueError("is not a number") from None
    if not math.isfinite(x):
        raise ValueError("is not a finite number")
    if minimum is not None and x < minimum:
        raise ValueError(f"must be at least {minimum}")
    if maximum is not None and x > maximum:
        raise ValueError(f"must be at most {maximum}")
    if above is not None and x <= above:
        raise ValueError(f"must be more than {above}")
    if below is not None and x >= below:
        raise ValueError(f"must be less than {below}")
    return x


_TRUE = {"1", "true", "yes", "on", "y"}
_FALSE = {"0", "false", "no", "off", "n"}


def parse_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise ValueError("is not true/false")


def parse_auto_bool(value: Any) -> str | bool:
    """'auto', or true/false (on/off, yes/no)."""
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    try:
        return parse_bool(value)
    except ValueError:
        raise ValueError("is not auto, on or off") from None


def parse_choice(value: Any, choices: tuple[str, ...]) -> str:
    text = str(value).strip().lower()
    if text not in choices:
        raise ValueError(f"is not one of {', '.join(choices)}")
    return text


def parse_auto_int(value: Any, *, words: tuple[str, ...] = ("auto",)) -> str | int:
    """One of `words` (default 'auto') or a positive whole number."""
    text = str(value).strip().lower()
    if text in words:
        return text
    try:
        return parse_int(value, minimum=1)
    except ValueError:
        raise ValueError(f"is not {' or '.join(words)} or a positive whole number") from None


_WEIGHT_RE = re.compile(r"^(?P<source>.+):(?P<weight>[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)$")


def split_weight(entry: str) -> tuple[str, float | None]:
    """'SOURCE:WEIGHT' -> (SOURCE, weight); a source without a numeric tail (`builtin:passkey`) has none."""
    match = _WEIGHT_RE.match(entry.strip())
    if not match:
        return entry.strip(), None
    weight = float(match.group("weight"))
    if not (math.isfinite(weight) and weight > 0):
        raise ValueError(f"entry {entry.strip()!r} has the weight {match.group('weight')}; a mixture weight is a number "
                         "> 0, e.g. a.jsonl:0.7")
    return match.group("source"), weight


def parse_data_sources(value: Any) -> str | list[str]:
    """One data source, or several (a list, each `SOURCE` or `SOURCE:WEIGHT`): a mixture."""
    items = list(value) if isinstance(value, (list, tuple)) else [value]
    if not items or not all(isinstance(v, str) and v.strip() for v in items):
        raise ValueError("must be a data source, or a list of them (e.g. [a.jsonl:0.7, b/:0.3])")
    for item in items:
        split_weight(item)
    return items[0].strip() if len(items) == 1 else [v.strip() for v in items]


def parse_auto_float(value: Any, *, minimum: float) -> str | float:
    """'auto' or a finite number >= `minimum`."""
    if str(value).strip().lower() == "auto":
        return "auto"
    try:
        return parse_float(value, minimum=minimum)
    except ValueError as exc:
        raise ValueError(f"is not auto or a number ({exc})") from None


def parse_auto_off_int(value: Any) -> str | int:
    """'auto', 'off' or a positive whole number (a tile count)."""
    return parse_auto_int(value, words=("auto", "off"))


def parse_optional_str(value: Any) -> str | None:
    if value is None:
        return None
    text = str(value).strip()
    return text or None


def parse_str_list(
    value: Any,
    *,
    items: str = "names",
    hint: str = "one or more names, comma-separated",
    auto: bool = True,
) -> list[str] | str:
    """A list of names (YAML list or comma-separated string), or 'auto' when `auto`. `items` (what the names
    are) and `hint` (what to give instead) complete the error messages, so each setting names its own values."""
    if isinstance(value, (list, tuple)):
        if not all(isinstance(v, str) for v in value):
            raise ValueError(f"must be a list of {items} (strings); give {hint}")
        given = [v.strip() for v in value]
    else:
        text = str(value).strip()
        if auto and text.lower() == "auto":
            return "auto"
        given = [s.strip() for s in text.split(",")]
    names = [s for s in given if s]
    if not names:
        raise ValueError(f"is empty; give {hint}")
    return names


def parse_model_name(value: Any) -> str:
    """--model: a non-empty name (an empty one would be read as the current folder)."""
    text = str(value).strip()
    if not text:
        raise ValueError("is empty; give a preset (`lstune presets`), a local model folder or a hub id like "
                         "meta-llama/Llama-3.1-8B")
    return text


def format_length(n: int) -> str:
    """32768 -> '32k', 1048576 -> '1M', 1572864 -> '1.5M', 1000 -> '1000'."""
    for unit, size in (("M", 1024**2), ("k", 1024)):
        if n >= size and (n * 2) % size == 0:
            value = n / size
            return f"{value:g}{unit}"
    return str(n)


# The record fields lstune reads (lstune.data.records.KIND_FIELDS and OPTIONAL_FIELDS; a test keeps them equal).
RECORD_FIELDS = ("text", "messages", "input_ids", "labels", "attention_mask", "prompt", "completion", "instruction",
                 "output", "input", "system", "conversations")


def parse_field_map(value: Any) -> dict[str, str] | None:
    """--data-fields: 'text=body' or 'prompt=question,completion=answer' (a recipe may give a mapping
    {text: body} or a list of FIELD=COLUMN) -> {lstune field: the data's column}."""
    if value is None:
        return None
    if isinstance(value, dict):
        pairs = [(str(k).strip(), str(v).strip()) for k, v in value.items()]
    else:
        items = value if isinstance(value, (list, tuple)) else str(value).split(",")
        pairs = [tuple(part.strip() for part in str(item).split("=", 1)) for item in items if str(item).strip()]
    if not pairs or any(len(pair) != 2 or not all(pair) for pair in pairs):
        raise ValueError("must be FIELD=COLUMN pairs, comma-separated, e.g. text=body or "
                         "prompt=question,completion=answer")
    unknown = [field for field, _ in pairs if field not in RECORD_FIELDS]
    if unknown:
        raise ValueError(f"names {', '.join(map(repr, unknown))}, not a field lstune reads; the fields are "
                         f"{', '.join(RECORD_FIELDS)}")
    mapping = dict(pairs)
    if len(mapping) != len(pairs) or len(set(mapping.values())) != len(pairs):
        raise ValueError("names a field or a column twice; give each once")
    return mapping
