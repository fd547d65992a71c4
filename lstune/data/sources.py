"""Resolve a `--data SOURCE` string to a `datasets.Dataset` of raw records.

Accepted, in this order: `builtin:NAME` (a file bundled with lstune); an existing local file
(.jsonl, .json, .parquet, .arrow) or folder (written by `save_to_disk`, or holding such files);
anything else is tried as a Hugging Face hub dataset name. Every format is read by the
`datasets` library, which converts it once to memory-mapped Arrow in its cache, so a few GB of
text never has to fit in RAM.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from lstune.config.parse import split_weight
from lstune.errors import DataError

if TYPE_CHECKING:
    from datasets import Dataset

# The built-in sources (lstune.data.synthetic): the bundled passkey task as text, as prompt + completion
# (loss on the key only), and held-out answer records for validation.
BUILTINS = ("passkey", "passkey-answer", "passkey-eval")
# File suffix -> the `datasets` packaged builder that reads it.
BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".arrow": "arrow"}
ACCEPTED = (
    "a .jsonl/.json/.parquet/.arrow file or a folder of them, a folder written by "
    "datasets' save_to_disk, builtin:passkey (or builtin:passkey-answer, builtin:passkey-eval), or a hub dataset name"
)


@dataclass(frozen=True)
class Records:
    """Raw records and where they came from (`origin` is shown in the data summary)."""

    dataset: Dataset
    origin: str


def mixture_entries(source: str | list[str]) -> list[tuple[str, float | None]]:
    """(source, weight or None) for each entry of `--data` (one for a single source, never weighted)."""
    entries = source if isinstance(source, list) else [source]
    return [split_weight(entry) if len(entries) > 1 else (entry, None) for entry in entries]


def check_source(source: str) -> None:
    """DataError when `source` names a bundled dataset that does not exist, or is meant as a local path
    (see `looks_like_path`) that does not exist. Cheap: the CLI runs it before anything is loaded."""
    if source.startswith("builtin:"):
        name = source.removeprefix("builtin:")
        if name not in BUILTINS:
            raise DataError(f"data source builtin:{name}: no such built-in dataset; available: "
                            + ", ".join(f"builtin:{n}" for n in BUILTINS) + ".")
    elif looks_like_path(source) and not Path(source).expanduser().exists():
        raise DataError(f"data source {source}: no such file or folder (it does not exist). Check the path; "
                        f"accepted: {ACCEPTED}.")


# A JSON record (one line of a .jsonl file) is refused past the bytes a sample can use: `record_byte_limit`.
# datasets' JSON reader takes minutes and ~22x a line's size in memory for one huge line (a 200 MB line: ~4.4 GB)
# before lstune keeps the sample's `seq_len` tokens of it.
MIN_RECORD_BYTES = 64 * 2**20
RECORD_BYTES_PER_TOKEN = 64  # JSON of a token: its text (escaped: up to 6 bytes a character) or its id and comma


def record_byte_limit(seq_len: int) -> int:
    """The largest JSON record a sample of `seq_len` tokens could need (at least MIN_RECORD_BYTES)."""
    return max(MIN_RECORD_BYTES, seq_len * RECORD_BYTES_PER_TOKEN)


def load_records(source: str, *, max_records: int | None = None, max_record_bytes: int | None = None) -> Records:
    """The raw records of `source` (only the first `max_records` when given); DataError if none, or if a JSON
    Lines record is longer than `max_record_bytes`."""
    check_source(source)
    if source.startswith("builtin:"):
        records = _load_builtin(source.removeprefix("builtin:"))
    elif Path(source).expanduser().exists():
        records = _load_local(Path(source).expanduser(), max_record_bytes)
    else:
        records = _load_hub(source)
    if len(records.dataset) == 0:
        raise DataError(f"data source {source}: {records.origin} has no records. "
                        "Point the data source at a non-empty dataset.")
    if max_records is not None and max_records < len(records.dataset):
        records = Records(records.dataset.select(range(max_records)), records.origin)
    return records


def _load_builtin(name: str) -> Records:
    from lstune.data import synthetic

    if name == "passkey":
        return Records(_read_files("json", [synthetic.BUNDLED_PASSKEY]), "builtin:passkey")
    if name == "passkey-answer":
        lines = synthetic.BUNDLED_PASSKEY.read_text().splitlines()
        records = [synthetic.answer_record(json.loads(line)) for line in lines]
    else:
        records = synthetic.heldout_records()
    from datasets import Dataset

    return Records(Dataset.from_list(records), f"builtin:{name}")


def _load_local(path: Path, max_record_bytes: int | None = None) -> Records:
    from lstune.untrusted import path_kind

    if path_kind(path) not in ("a file", "a folder"):
        raise DataError(f"data source {path} is {path_kind(path)}, not a file or folder of records; pass a "
                        ".jsonl/.json/.parquet/.arrow file or a folder of them.")
    if path.is_file():
        builder = _builder_for(path)
        if path.stat().st_size == 0:
            raise DataError(f"data source {path}: the file is empty. "
                            "Point the data source at a file with records.")
        _check_line_lengths([path], max_record_bytes)
        return Records(_read_files(builder, [path]), f"{builder} file {path}")
    if (path / "dataset_dict.json").is_file() or (path / "state.json").is_file():
        return _load_saved(path)
    return _load_folder(path, max_record_bytes)


def _check_line_lengths(files: list[Path], limit: int | None) -> None:
    """DataError naming the file and line of the first JSON Lines record longer than `limit` bytes. Streams each
    file that could hold one (a smaller file cannot) in 8 MiB blocks: memory stays one block."""
    for path in files:
        if limit is None or path.suffix.lower() != ".jsonl" or path.stat().st_size <= limit:
            continue
        line, run = 1, 0
        with open(path, "rb") as f:
            while block := f.read(8 * 2**20):
                pieces = block.split(b"\n")
                for i, piece in enumerate(pieces):
                    run += len(piece)
                    if run > limit:
                        break
                    if i < len(pieces) - 1:
                        line, run = line + 1, 0
                else:
                    continue
                raise DataError(
                    f"{path} line {line} is longer than {limit / 2**20:,.0f} MiB, more than a sample of this "
                    "--seq-len can use (lstune keeps its first --seq-len tokens, and reading such a line takes "
                    "minutes and ~20x its size in memory). Split the record into documents, or shorten it.")


def _builder_for(path: Path) -> str:
    builder = BUILDERS.get(path.suffix.lower())
    if builder is None:
        raise DataError(f"data source {path}: unsupported file type {path.suffix!r}; "
                        "use .jsonl, .json, .parquet or .arrow.")
    return builder


def _load_saved(path: Path) -> Records:
    """A folder written by `Dataset.save_to_disk` (or `DatasetDict.save_to_disk`: its train split)."""
    from datasets import DatasetDict, load_from_disk

    saved = load_from_disk(str(path))
    if not isinstance(saved, DatasetDict):
        return Records(saved, f"save_to_disk folder {path}")
    if "train" not in saved:
        raise DataError(f"data source {path}: the saved DatasetDict has splits {sorted(saved)} but no "
                        "'train'. Save the split to train on as 'train', or point the data source at "
                        "that split's folder.")
    return Records(saved["train"], f"save_to_disk folder {path} (split train)")


def _load_folder(path: Path, max_record_bytes: int | None = None) -> Records:
    """All data files under `path` (recursively, hidden ones skipped), which must share one format."""
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in BUILDERS
                   and not any(part.startswith(".") for part in p.relative_to(path).parts))
    nonempty = [p for p in files if p.stat().st_size > 0]
    if not nonempty:
        what = "only empty data files" if files else "no .jsonl/.json/.parquet/.arrow files"
        raise DataError(f"data source {path}: the folder has {what}. Put the training records there, "
                        f"or pass {ACCEPTED}.")
    builders = {BUILDERS[p.suffix.lower()] for p in nonempty}
    if len(builders) > 1:
        raise DataError(f"data source {path}: the folder mixes formats ({', '.join(sorted(builders))}). "
                        "Keep one format per folder, or point the data source at a single file.")
    builder = builders.pop()
    _check_line_lengths(nonempty, max_record_bytes)
    return Records(_read_files(builder, nonempty), f"folder {path} ({len(nonempty)} {builder} files)")


def _read_files(builder: str, files: list[Path]) -> Dataset:
    from datasets import load_dataset

    names = ", ".join(str(p) for p in files[:3]) + (" ..." if len(files) > 3 else "")
    try:
        with _quiet_datasets():  # its parse errors are reported below, once, with the file and line
            dataset = load_dataset(builder, data_files=[str(p) for p in files], split="train")
        # Arrow keeps text bytes as they were read; invalid UTF-8 would only fail later, mid-tokenization.
        dataset.data.table.validate(full=True)
        return dataset
    except ValueError as e:
        # datasets refuses to build a split of zero rows with this message; it is the user's empty data.
        if "corresponds to no data" not in str(e):
            raise _unreadable(names, builder, e, files) from e
        raise DataError(f"data source {names}: no records. "
                        "Point the data source at a non-empty dataset.") from e
    except Exception as e:  # any parse failure of user files is a data problem, not an lstune bug
        raise _unreadable(names, builder, e, files) from e


@contextmanager
def _quiet_datasets():
    import logging

    logger = logging.getLogger("datasets")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def _unreadable(names: str, builder: str, e: Exception, files: list[Path]) -> DataError:
    where = _first_bad_line(files) if builder == "json" else None
    if where is not None:
        return DataError(f"data source: {where}. Fix that line (each line of a .jsonl file is one JSON record, "
                         "in UTF-8).")
    detail = str(e).splitlines()[0][:300] if str(e) else ""
    return DataError(
        f"data source: could not read {names} as {builder}: {type(e).__name__}: {detail}. "
        "Check that the file is valid (.json: one list of records or one record per line)."
    )


def _first_bad_line(files: list[Path]) -> str | None:
    """'FILE line N: what is wrong' for the first line that is not UTF-8 or not JSON; read only after
    a load failed, so valid data never pays for this second pass."""
    for path in files:
        with open(path, "rb") as f:
            if path.suffix.lower() == ".json":
                problem = _json_document_problem(f.read())
                if problem:
                    return f"{path} {problem}"
                continue
            for number, raw in enumerate(f, start=1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as exc:
                    return f"{path} line {number} is not UTF-8 text (byte {exc.start + 1} is {raw[exc.start]:#04x})"
                problem = _json_line_problem(line, number)
                if problem:
                    return f"{path} {problem}"
    return None


def _json_document_problem(data: bytes) -> str | None:
    import json

    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        return f"line {line} is not UTF-8 text (byte {data[exc.start]:#04x})"
    try:
        json.loads(text)
    except json.JSONDecodeError as exc:
        if text.lstrip().startswith("{") and "\n{" in text:
            return _jsonl_lines_problem(text)
        return f"line {exc.lineno} is not valid JSON ({exc.msg}, column {exc.colno})"
    return None


def _jsonl_lines_problem(text: str) -> str | None:
    """A .json file holding one record per line (datasets accepts that too)."""
    for number, line in enumerate(text.splitlines(), start=1):
        problem = _json_line_problem(line, number)
        if problem:
            return problem
    return None


def _json_line_problem(line: str, number: int) -> str | None:
    import json

    if not line.strip():
        return None
    try:
        json.loads(line)
    except json.JSONDecodeError as exc:
        return f"line {number} is not valid JSON ({exc.msg}, column {exc.colno})"
    return None


def _load_hub(name: str) -> Records:
    from datasets import load_dataset

    try:
        dataset = load_dataset(name, split="train")
    except Exception as e:  # offline, unknown name, gated, no train split: all need the user's action
        raise DataError(
            f"data source {name!r} is neither a local path nor a reachable hub dataset "
            f"({type(e).__name__}: {e}). "
            f"Pass {ACCEPTED}; for a hub dataset, check the name and that the network is reachable "
            "(HF_HUB_OFFLINE / HF_DATASETS_OFFLINE unset), or download it first and pass the local folder."
        ) from e
    return Records(dataset, f"hub dataset {name} (split train)")


def looks_like_path(source: str) -> bool:
    """Meant as a local path, so a missing one is a typo, not a hub name to look up: it starts like a path,
    ends in a data file suffix, or has more folders than a hub id (`org/name`) can."""
    return (
        source.startswith(("/", "./", "../", "~"))
        or Path(source).suffix.lower() in BUILDERS
        or source.count("/") > 1
    )
