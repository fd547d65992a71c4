"""Resolve a `--data SOURCE` string to a `datasets.Dataset` of raw records.

Accepted, in this order: `builtin:NAME` (a file bundled with lstune); an existing local file
(.jsonl, .json, .parquet, .arrow) or folder (written by `save_to_disk`, or holding such files);
anything else is tried as a Hugging Face hub dataset name. Every format is read by the
`datasets` library, which converts it once to memory-mapped Arrow in its cache, so a few GB of
text never has to fit in RAM.
"""

from __future__ import annotations

import errno
import json
import shutil
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


def check_source(source: str, *, split: str | None = None, subset: str | None = None) -> None:
    """DataError when `source` names a bundled dataset that does not exist, or is meant as a local path
    (see `looks_like_path`) that does not exist, or has no splits or subsets to pick from (`_check_parts`).
    Cheap: the CLI runs it before anything is loaded."""
    _check_parts(source, split, subset)
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


def _check_parts(source: str, split: str | None, subset: str | None) -> None:
    """--data-subset picks a hub dataset's configuration; --data-split a split of a hub dataset or of a saved
    DatasetDict folder. A built-in source or a data file has neither."""
    path = Path(source).expanduser()
    local = not source.startswith("builtin:") and (path.exists() or looks_like_path(source))
    if subset is not None and (source.startswith("builtin:") or local):
        raise DataError(f"--data-subset {subset!r} picks a hub dataset's subset, and {source} is not a hub dataset; "
                        "drop --data-subset (for a local copy, point --data at the subset's files).")
    saved = path.is_dir() and ((path / "dataset_dict.json").is_file() or (path / "state.json").is_file())
    if split not in (None, "train") and (source.startswith("builtin:") or (local and not saved)):
        raise DataError(f"--data-split {split!r} picks a split of a hub dataset or of a saved DatasetDict folder; "
                        f"{source} has only its records (one split): drop --data-split, or point --data at the "
                        "split's own file.")


def load_records(source: str, *, max_records: int | None = None, split: str | None = None,
                 subset: str | None = None, fields: dict[str, str] | None = None,
                 max_record_bytes: int | None = None) -> Records:
    """The raw records of `source` (only the first `max_records` when given); DataError if none, or if a JSON
    Lines record is longer than `max_record_bytes`. `split` and
    `subset` pick a part of a hub dataset or saved DatasetDict (default: its train split); `fields` maps
    lstune's field names to the data's columns ({"text": "body"}: the column body is read as text)."""
    check_source(source, split=split, subset=subset)
    if source.startswith("builtin:"):
        records = _load_builtin(source.removeprefix("builtin:"))
    elif Path(source).expanduser().exists():
        records = _load_local(Path(source).expanduser(), split, max_record_bytes)
    else:
        records = _load_hub(source, split, subset)
    if fields:
        records = _map_fields(records, fields, source)
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


def _map_fields(records: Records, fields: dict[str, str], source: str) -> Records:
    """The columns named in `fields` renamed to lstune's fields; a column already bearing such a name is refused
    (which of the two to train on would be a guess)."""
    renamed = field_renames(records.dataset.column_names, fields, source)
    return Records(records.dataset.rename_columns(renamed), f"{records.origin}, fields {mapped_fields(fields)}")


def field_renames(columns: list[str], fields: dict[str, str], source: str) -> dict[str, str]:
    """{column: field} for `rename_columns`; DataError for a missing column or a clash (shared with streaming)."""
    missing = [column for column in fields.values() if column not in columns]
    if missing:
        raise DataError(f"--data-fields: {source} has no column {', '.join(map(repr, missing))}; its columns are "
                        f"{', '.join(columns)}.")
    clash = [field for field, column in fields.items() if field in columns and field != column
             and field not in fields.values()]
    if clash:
        raise DataError(f"--data-fields: {source} already has a column {', '.join(map(repr, clash))}; map that "
                        "name too (e.g. text=body,body=text swaps them) or drop the mapping.")
    return {column: field for field, column in fields.items() if field != column}


def mapped_fields(fields: dict[str, str]) -> str:
    return ", ".join(f"{field}={column}" for field, column in fields.items())


def _load_local(path: Path, split: str | None = None, max_record_bytes: int | None = None) -> Records:
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
        records = Records(_read_files(builder, [path]), f"{builder} file {path}")
        return _checked_rows(records, max_record_bytes) if builder == "arrow" else records
    if (path / "dataset_dict.json").is_file() or (path / "state.json").is_file():
        return _checked_rows(_load_saved(path, split or "train"), max_record_bytes)
    return _load_folder(path, max_record_bytes)


def _checked_rows(records: Records, limit: int | None) -> Records:
    """`records`, after a DataError naming the first one longer than `limit` bytes as stored (Arrow files and
    save_to_disk folders, memory-mapped; JSON and Parquet files are checked before datasets reads them,
    `_check_line_lengths`)."""
    if limit is not None:
        from lstune.data.record_size import check_rows

        check_rows(records.dataset, limit, records.origin)
    return records


def _check_line_lengths(files: list[Path], limit: int | None) -> None:
    """DataError naming the file and line of the first JSON Lines record longer than `limit` bytes. Streams each
    file that could hold one (a smaller file cannot) in 8 MiB blocks: memory stays one block. A .json file's
    records (array items, or top-level values) are found by its structure, a Parquet file's from its row groups
    (`record_size`)."""
    for path in files:
        if limit is not None and path.suffix.lower() == ".json":
            from lstune.data.record_size import check_json_file

            check_json_file(path, limit)
            continue
        if limit is not None and path.suffix.lower() == ".parquet":
            from lstune.data.record_size import check_parquet_file

            check_parquet_file(path, limit)
            continue
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


def _load_saved(path: Path, split: str) -> Records:
    """A folder written by `Dataset.save_to_disk` (one split), or by `DatasetDict.save_to_disk` (`split` of it)."""
    from datasets import DatasetDict, load_from_disk

    saved = load_from_disk(str(path))
    if not isinstance(saved, DatasetDict):
        if split != "train":
            raise DataError(f"--data-split {split!r}: {path} was saved as one Dataset, with no splits; drop "
                            "--data-split.")
        return Records(saved, f"save_to_disk folder {path}")
    if split not in saved:
        raise DataError(f"data source {path}: the saved DatasetDict has splits {sorted(saved)} but no {split!r}. "
                        "Pick one with --data-split (default train), or point the data source at that split's folder.")
    return Records(saved[split], f"save_to_disk folder {path} (split {split})")


def _load_folder(path: Path, max_record_bytes: int | None = None) -> Records:
    """All data files under `path` (recursively, hidden ones skipped), which must share one format."""
    builder, nonempty = folder_files(path)
    _check_line_lengths(nonempty, max_record_bytes)
    records = Records(_read_files(builder, nonempty), f"folder {path} ({len(nonempty)} {builder} files)")
    return _checked_rows(records, max_record_bytes) if builder == "arrow" else records


def folder_files(path: Path) -> tuple[str, list[Path]]:
    """(the builder, the non-empty data files) of a folder of data files; DataError for none or mixed formats."""
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
    return builders.pop(), nonempty


def _read_files(builder: str, files: list[Path]) -> Dataset:
    from datasets import load_dataset

    names = ", ".join(str(p) for p in files[:3]) + (" ..." if len(files) > 3 else "")
    _check_cache_room(files, names)
    try:
        with _quiet_datasets():  # its parse errors are reported below, once, with the file and line
            dataset = load_dataset(builder, data_files=[str(p) for p in files], split="train")
        # Arrow keeps text bytes as they were read; invalid UTF-8 would only fail later, mid-tokenization.
        dataset.data.table.validate(full=True)
        return dataset
    except OSError as e:
        if e.errno != errno.ENOSPC:
            raise _unreadable(names, builder, e, files) from e
        raise _no_cache_room(names, sum(p.stat().st_size for p in files)) from e
    except ValueError as e:
        # datasets refuses to build a split of zero rows with this message; it is the user's empty data.
        if "corresponds to no data" not in str(e):
            raise _unreadable(names, builder, e, files) from e
        raise DataError(f"data source {names}: no records. "
                        "Point the data source at a non-empty dataset.") from e
    except Exception as e:  # any parse failure of user files is a data problem, not an lstune bug
        raise _unreadable(names, builder, e, files) from e


def _check_cache_room(files: list[Path], names: str) -> None:
    """Sources larger than memory need no streaming: datasets converts them once to Arrow files in its cache and
    memory-maps those, so RAM is not the limit; the cache's disk is. A source larger than that disk's free space
    cannot be converted (its Arrow copy is at least about its size): refused with both sizes, before the
    conversion fills the disk."""
    import shutil

    from datasets import config

    total = sum(p.stat().st_size for p in files)
    cache = Path(config.HF_DATASETS_CACHE)
    existing = next((parent for parent in (cache, *cache.parents) if parent.exists()), Path("/"))
    free = shutil.disk_usage(existing).free
    if total > free:
        raise _no_cache_room(names, total, free, cache)


def _no_cache_room(names: str, total: int, free: int | None = None, cache: Path | None = None) -> DataError:
    from datasets import config

    cache = cache or Path(config.HF_DATASETS_CACHE)
    room = f" and {_gib(free)} is free there" if free is not None else ", and that disk filled up"
    return DataError(f"data source {names} is {_gib(total)}: datasets converts it once to memory-mapped Arrow files "
                     f"in its cache ({cache}){room}. Point HF_DATASETS_CACHE at a disk with room for at least "
                     f"{_gib(total)}, or train on a part of the files.")


def _gib(n: int) -> str:
    unit, size = next((u, s) for u, s in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10), ("bytes", 1)) if n >= s or s == 1)
    return f"{n / size:.1f} {unit}" if size > 1 else f"{n} bytes"


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


def _load_hub(name: str, split: str | None = None, subset: str | None = None) -> Records:
    from datasets import load_dataset

    split = split or "train"
    check_hub_size(name, subset)
    try:
        dataset = load_dataset(name, subset, split=split)
    except Exception as e:  # offline, unknown name, gated, no train split: all need the user's action
        raise DataError(
            f"data source {name!r} is neither a local path nor a reachable hub dataset "
            f"({type(e).__name__}: {e}). "
            f"Pass {ACCEPTED}; for a hub dataset, check the name, --data-subset and --data-split, and that the network is reachable "
            "(HF_HUB_OFFLINE / HF_DATASETS_OFFLINE unset), or download it first and pass the local folder."
        ) from e
    part = f"subset {subset}, split {split}" if subset else f"split {split}"
    return Records(dataset, f"hub dataset {name} ({part})")


def check_hub_size(name: str, subset: str | None) -> None:
    """DataError, before any download, when the hub dataset's download and Arrow files (as its builder's info
    gives them; many datasets state them, some do not: then nothing is checked) exceed the free space of the
    datasets cache's disk; --data-streaming reads it without storing it."""
    from datasets import config, load_dataset_builder

    try:
        with _quiet_datasets():
            builder = load_dataset_builder(name, subset)
    except Exception:  # offline, unknown, gated: the load that follows reports it with the fix
        return
    if Path(builder.cache_dir).exists():
        return  # prepared by an earlier load: nothing more to store
    download, arrow = builder.info.download_size or 0, builder.info.dataset_size or 0
    cache = Path(config.HF_DATASETS_CACHE)
    existing = next((parent for parent in (cache, *cache.parents) if parent.exists()), Path("/"))
    free = shutil.disk_usage(existing).free
    if download + arrow > free:
        raise DataError(
            f"data source {name!r}{f' (subset {subset})' if subset else ''} is {_gib(download)} to download and "
            f"{_gib(arrow)} as Arrow files in the datasets cache ({cache}), {_gib(download + arrow)} in all, and "
            f"{_gib(free)} is free there. Add --data-streaming to read it as a stream (nothing stored; docs/data.md), "
            "or point HF_DATASETS_CACHE at a disk with room.")


def looks_like_path(source: str) -> bool:
    """Meant as a local path, so a missing one is a typo, not a hub name to look up: it starts like a path,
    ends in a data file suffix, or has more folders than a hub id (`org/name`) can."""
    return (
        source.startswith(("/", "./", "../", "~"))
        or Path(source).suffix.lower() in BUILDERS
        or source.count("/") > 1
    )
