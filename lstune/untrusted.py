"""Reading files lstune did not write: a model's folder, a checkpoint's files, a template.

One reader per kind of file (JSON, safetensors, torch's zip/pickle format) that turns every parser error —
invalid or deeply nested JSON, a value of the wrong type, a safetensors header that lies, a pickle payload —
into a `UserError` (exit 2) naming the file and what is wrong, instead of the parser's traceback.

Pickles load only through torch's restricted unpickler (`weights_only=True`), which runs no code. Its
refusal tells the user that `weights_only=False` "will likely succeed" — the one thing that would run the
payload — so that advice is never shown: `describe` keeps only the reason.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lstune.errors import UserError

# JSON lstune reads from others' files (a model's config.json, a checkpoint's state) is small; the cap keeps a
# huge file from being read whole. Nesting past Python's recursion limit is json's RecursionError, caught.
MAX_JSON_BYTES = 64 * 1024 * 1024

# Sentences torch (2.6+) adds to a weights-only refusal that advise loading with the full unpickler.
_UNSAFE_ADVICE = re.compile(r"[^.\n]*weights_only[^\n]*(False|=\s*False)[^\n]*|[^.\n]*arbitrary code[^\n]*", re.I)


def describe(exc: BaseException) -> str:
    """A parser error's reason in one line, without advice to load with `weights_only=False`."""
    text = str(exc)
    if "Weights only load failed" in text:
        reasons = [line.strip() for line in text.splitlines()
                   if line.strip() and "weights_only" not in line and not line.startswith(("Check the doc", "Weights"))]
        reason = reasons[0] if reasons else "it holds Python objects other than tensors"
        return f"it holds objects lstune does not load from files it did not write ({reason.rstrip('.')})"
    if isinstance(exc, KeyError):
        return f"it has no {text} entry"
    text = _UNSAFE_ADVICE.sub("", text)
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__


def path_kind(path: Path) -> str:
    """What is at `path`, in words for a message: "a folder", "a file", "a FIFO (named pipe)", "a socket", "a device",
    "nothing" (a FIFO is neither a file nor a folder: reading one blocks until something writes to it)."""
    import stat

    try:
        mode = os.stat(path).st_mode
    except OSError:
        return "nothing"
    for test, kind in ((stat.S_ISDIR, "a folder"), (stat.S_ISREG, "a file"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a device"), (stat.S_ISBLK, "a device")):
        if test(mode):
            return kind
    return "not a file or folder"


def parser_errors() -> tuple[type[BaseException], ...]:
    """What torch, safetensors, pickle and json raise for a file that is not what it claims to be (safetensors'
    error derives from Exception alone). Catch these only around reading such a file."""
    import pickle
    import zipfile

    from safetensors import SafetensorError

    return (pickle.UnpicklingError, EOFError, ValueError, KeyError, TypeError, IndexError, AttributeError,
            RuntimeError, zipfile.BadZipFile, UnicodeDecodeError, SafetensorError)


def read_json(path: Path, *, error: Callable[[str], UserError] = UserError, what: str = "",
              expect: type = dict) -> Any:
    """The JSON value in `path`, of type `expect`. `error(message)` (a UserError) for an unreadable file, one over
    MAX_JSON_BYTES, invalid JSON or JSON nested past the recursion limit, and a value of another type."""
    path = Path(path)
    name = f"{what} {path}" if what else str(path)
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_JSON_BYTES + 1)
    except OSError as exc:
        raise error(f"{name} cannot be read ({exc.strerror or exc}).") from None
    if len(raw) > MAX_JSON_BYTES:
        raise error(f"{name} is larger than {MAX_JSON_BYTES // 2**20} MiB, more than such a file holds; "
                    "is it the right file?") from None
    try:
        value = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise error(f"{name} is not UTF-8 text (corrupt, or not a JSON file).") from None
    except RecursionError:
        raise error(f"{name} is nested too deeply to read (corrupt, or not a file of this kind).") from None
    except ValueError as exc:
        raise error(f"{name} is not valid JSON ({describe(exc)}).") from None
    if not isinstance(value, expect):
        raise error(f"{name} holds a JSON {type(value).__name__} where a {_json_type(expect)} belongs (corrupt).")
    return value


def _json_type(kind: type) -> str:
    return {dict: "object", list: "array", str: "string", int: "number"}.get(kind, kind.__name__)


def require(value: Any, kind: type | tuple[type, ...], where: str, error: Callable[[str], UserError]) -> Any:
    """`value` when it is of `kind` (a bool is not an int), else `error` naming `where` (file and key)."""
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        names = " or ".join(_json_type(k) for k in kinds)
        raise error(f"{where} is {value!r}, not a {names} (corrupt or edited).")
    return value


def check_safetensors(path: Path, *, error: Callable[[str], UserError] = UserError) -> None:
    """`error` naming `path` when its header is not what the safetensors format requires (sizes, offsets,
    dtypes, JSON); reads the header only (the library maps the file)."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            f.keys()
    except Exception as exc:  # noqa: BLE001 - SafetensorError and OSError alike: the file cannot be read as one
        raise error(f"{path} is not a valid safetensors file ({describe(exc)}).") from None


def torch_load(path: Path, *, error: Callable[[str], UserError] = UserError, **kwargs) -> Any:
    """`torch.load(path, weights_only=True)`: tensors and plain containers only, never code; every failure
    (a pickle payload, a truncated or foreign file) is `error` naming the file."""
    import torch

    try:
        return torch.load(str(path), weights_only=True, **kwargs)
    except (*parser_errors(), OSError) as exc:
        raise error(f"{path} cannot be loaded: {describe(exc)}.") from None
