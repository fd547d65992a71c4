"""Checkpoints that are written atomically, validated before loading, and pruned safely.

Promise: a checkpoint is either complete or absent. A save interrupted at any point (exception,
SIGKILL, power loss) leaves no `checkpoint-STEP/` folder behind; a partial or corrupt checkpoint is
refused before anything is loaded from it; nothing that is not an lstune checkpoint is ever
overwritten or deleted. Resuming in its own folder from a checkpoint that is not the newest there is
refused (`resolve_resume`), since saving and pruning by step would mix the two histories.

Layout::

    OUTPUT_DIR/checkpoint-STEP/         STEP = optimizer step, no zero padding
        ...                             engine files, written by `write_state` (HF model / PEFT adapter,
                                        optimizer, scheduler, or a DeepSpeed engine's own folders)
        trainer_state.json              the loop's `train_state` (step, samples, tokens, config, ...)
        rng_state.pt                    `lstune.train.rng` state; `rng_state-rankR.pt` per rank when
                                        several processes save together
        lstune-checkpoint.json          the manifest, written last: format version, step, world size,
                                        and every file's relative path, size and sha256

Save protocol (`save_checkpoint`):

1. Remove stale folders of ours left by an earlier crash (`.tmp-checkpoint-*`, and `.old-checkpoint-*`
   once its replacement is in place) — first, so their disk space is free before writing. Create
   `OUTPUT_DIR/.tmp-checkpoint-STEP-<random>/`.
2. `write_state(tmp)` writes the engine's files; then `trainer_state.json` and the RNG state.
3. Hash every file (sha256, streamed in 8 MiB blocks) and fsync it; fsync every folder.
4. Write the manifest LAST and fsync it: a folder without a manifest is, by construction, a save that
   did not finish.
5. `os.rename(tmp, checkpoint-STEP)` (atomic on POSIX) and fsync OUTPUT_DIR. When `checkpoint-STEP`
   already exists (a resumed run saving the same step again), it is renamed aside to
   `.old-checkpoint-STEP-<random>` first and deleted only after the new one is in place; if the process
   dies between those two renames, the next save renames the old one back.
6. Prune: keep the `keep_last` newest complete checkpoints (by step), always including the one just
   written; delete only other `checkpoint-N` folders that carry our manifest, each renamed to
   `.pruned-checkpoint-N-<random>` first (atomic), then deleted, so a crash while deleting never leaves
   a checkpoint folder half-deleted.

Every step before 5 works inside the temporary folder, so a crash there leaves the existing
checkpoints untouched; `find_latest_checkpoint` never sees a folder without a valid manifest.

Cost: hashing reads every file once more after writing it, streamed in 8 MiB blocks (no memory
grows with file size). Measured on the 2-core CI machine (AMD EPYC, shared): 0.4-0.6 GiB/s, i.e. about
2 s per GiB per save and again per load; one core with SHA extensions typically does 1-2 GB/s, and
disk reads often bound it. Files are hashed on a few threads (and split across ranks); each save and
load logs the time it took. Verifying before loading is slow for multi-GB checkpoints, but a corrupt
optimizer state would otherwise load silently and poison the run; `verify_hashes=False` skips it.

Several processes (torch.distributed): every rank calls `save_checkpoint` / `load_checkpoint` with the
same arguments, as DeepSpeed's own save needs every rank. Rank 0 picks the temporary folder and tells
the others; every rank's `write_state` writes into it (so OUTPUT_DIR must be on a file system all ranks
share, as DeepSpeed's multi-node checkpoints require); each rank stores its own RNG state; the ranks
split the hashing; rank 0 writes the manifest, renames and prunes. A failure on any rank (outside
`write_state`'s own collectives) makes every rank raise and removes the temporary folder, instead of
leaving the others waiting in a collective. One run per OUTPUT_DIR: a second run writing into the
same folder would see the first one's temporary folder as stale.

Written by hand because no library in use offers it: the HF Trainer and accelerate's `save_state` write
straight into the final folder (an interrupted save looks complete); DeepSpeed writes its `latest` tag
file last but its tag folder is written in place; none records checksums to detect a corrupt file.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import secrets
import shutil
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from lstune.train.atomic import apply_umask, fsync_dir
from lstune.errors import CheckpointError
from lstune.parallel.comm import Communicator
from lstune.untrusted import describe, parser_errors, path_kind, read_json

logger = logging.getLogger(__name__)

MANIFEST_NAME = "lstune-checkpoint.json"
TRAINER_STATE_NAME = "trainer_state.json"
FORMAT_NAME = "lstune-checkpoint"
FORMAT_VERSION = 1

_HASH_BLOCK_BYTES = 8 * 1024 * 1024
_HASH_THREADS = 4
_CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")
_STALE_RE = re.compile(r"^\.(tmp|old|pruned)-checkpoint-(\d+)-[0-9a-f]{8}$")


def rng_state_name(rank: int, world_size: int) -> str:
    """File name of one rank's RNG state inside a checkpoint."""
    return "rng_state.pt" if world_size == 1 else f"rng_state-rank{rank}.pt"


# ----------------------------------------------------------------------------------------------------
# Public API


def save_checkpoint(
    output_dir: Path,
    step: int,
    *,
    write_state: Callable[[Path], None],
    train_state: dict,
    keep_last: int | None = None,
    group: Any = None,
) -> Path:
    """Write `OUTPUT_DIR/checkpoint-STEP/` atomically and return its path (see the module docstring).

    `write_state(folder)` writes the engine's files into `folder` (a temporary folder, renamed when
    everything is written). `train_state` must be JSON-serialisable; its "step", if present, must equal
    `step`. `keep_last` keeps that many newest complete checkpoints (None keeps all). `group` is the
    torch.distributed process group saving together; None means the default group when
    torch.distributed is initialised (every rank must take part in a distributed save), else this
    process alone.
    """
    if not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be a non-negative int, got {step!r}")
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"keep_last must be >= 1 or None, got {keep_last!r}")
    state_json = _train_state_json(step, train_state)  # fails before any file is written
    comm = Communicator.of(group)
    output_dir = Path(output_dir)
    token = comm.broadcast(secrets.token_hex(4) if comm.rank == 0 else None)
    save = _Save(output_dir, step, token, comm)

    save.on_all_ranks(lambda: save.prepare() if comm.rank == 0 else None)
    save.on_all_ranks(lambda: save.write(write_state, state_json))
    started = time.perf_counter()
    files = save.on_all_ranks(lambda: _list_files(save.tmp) if comm.rank == 0 else None)[0]
    hashes = save.on_all_ranks(lambda: _hash_share(save.tmp, files, comm, fsync=True))
    save.on_all_ranks(lambda: save.publish(_merge(hashes), keep_last) if comm.rank == 0 else None)
    _log_hashing("saved", save.final, files, started)
    return save.final


def find_latest_checkpoint(output_dir: Path) -> Path | None:
    """The complete checkpoint with the highest step in `output_dir`, or None.

    Complete means: a valid manifest, and every file it lists present with its recorded size. Hashes
    are not checked here (that would read every checkpoint); `load_checkpoint` checks them.
    """
    for _, path in _checkpoint_dirs(Path(output_dir)):
        problems = _problems(path, verify_hashes=False)
        if not problems:
            return path
        logger.warning("skipping %s: %s", path, "; ".join(problems))
    return None


def saved_step(path: Path) -> int | None:
    """The step `path` was saved at, from its manifest (None when that cannot be read: loading it says why)."""
    try:
        step = _read_manifest(Path(path)).get("step")
    except _Invalid:
        return None
    return step if isinstance(step, int) else None


def validate_checkpoint(path: Path, *, verify_hashes: bool = True) -> dict:
    """The checkpoint's manifest, after checking every file it lists (size, and sha256 unless told not).

    Raises `CheckpointError` naming each problem (no manifest = a partial save; a missing, truncated or
    corrupt file) and the fix: the earlier complete checkpoints to resume from instead.
    """
    return _validate(Path(path), verify_hashes, Communicator())


def load_checkpoint(
    path: Path,
    *,
    read_state: Callable[[Path], None],
    restore_rng: bool = True,
    verify_hashes: bool = True,
    group: Any = None,
) -> dict:
    """Validate the checkpoint, then `read_state(path)`, then restore the RNG state; return train_state.

    Validation (and reading lstune's own files) comes first, so a partial or corrupt checkpoint raises
    `CheckpointError` before `read_state` touches the model or optimizer. `group` as in
    `save_checkpoint`: in a distributed run every rank calls this, the ranks split the hashing, and
    each restores its own RNG state.
    """
    path = Path(path)
    comm = Communicator.of(group)
    started = time.perf_counter()
    manifest = _validate(path, verify_hashes, comm)
    if verify_hashes:
        _log_hashing("verified", path, [entry["path"] for entry in manifest["files"]], started)
    train_state = read_train_state(path)
    rng_state = _read_rng_state(path, manifest, comm) if restore_rng else None
    from lstune.train.rng import restore_rng_state

    try:
        read_state(path)
        if rng_state is not None:
            restore_rng_state(rng_state)
    except parser_errors() as exc:  # the engine's files, read by torch, safetensors or DeepSpeed: not ours to trust
        raise CheckpointError(f"Checkpoint {path} cannot be loaded: {describe(exc)}.") from exc
    return train_state


# The train state's fields and their types: a crafted or edited trainer_state.json is refused, not a traceback.
_TRAIN_STATE_FIELDS = {"step": int, "consumed_samples": int, "tokens_seen": int, "config": dict,
                       "stream_order": dict}


def read_train_state(path: Path) -> dict:
    """`trainer_state.json` of the checkpoint at `path`, its fields' types checked (CheckpointError naming the
    file and field otherwise). Read as any file lstune did not write: its manifest hash proves only that it is
    the file saved with it, and a copied or crafted checkpoint carries a recomputed manifest."""
    from lstune.untrusted import read_json, require

    file = path / TRAINER_STATE_NAME
    state = read_json(file, error=CheckpointError)
    for key, kind in _TRAIN_STATE_FIELDS.items():
        if key in state or key == "step":
            require(state.get(key), kind, f"{file}: {key}", CheckpointError)
            if kind is int and state[key] < 0:
                raise CheckpointError(f"{file}: {key} is {state[key]}, not a count (corrupt or edited).")
    return state


def resolve_resume(output_dir: Path, resume: str | Path | bool | None) -> Path | None:
    """The checkpoint a run should resume from, or None to start fresh.

    - None / False: start fresh.
    - True / "latest": the latest complete checkpoint in `output_dir`; `CheckpointError` if there is none.
    - "auto": the latest complete checkpoint if there is one, else start fresh (for jobs that are
      requeued after preemption and run the same command again).
    - a path: that checkpoint folder, or the latest complete checkpoint of the output folder it names. A
      checkpoint folder inside `output_dir` must be the newest of lstune's checkpoints there
      (`_refuse_a_branch`).
    """
    if resume is None or resume is False:
        return None
    output_dir = Path(output_dir)
    mode = "latest" if resume is True else resume.lower() if isinstance(resume, str) else None
    if mode in ("latest", "auto"):
        latest = find_latest_checkpoint(output_dir)
        if latest is None and mode == "latest":
            raise CheckpointError(_nothing_to_resume(output_dir))
        return latest
    path = Path(resume).expanduser()
    if path.exists() and not path.is_dir():
        raise CheckpointError(
            f"Cannot resume from {path}: it is {path_kind(path)}, not a folder. Pass a checkpoint folder "
            f"(OUTPUT_DIR/checkpoint-STEP) or an output folder that holds checkpoints."
        )
    if not path.exists():
        raise CheckpointError(
            f"Cannot resume from {path}: it does not exist. Pass a checkpoint folder "
            f"(OUTPUT_DIR/checkpoint-STEP) or an output folder that holds checkpoints."
        )
    if _CHECKPOINT_RE.match(path.name) or (path / MANIFEST_NAME).exists():
        manifest = validate_checkpoint(path, verify_hashes=False)
        _refuse_a_branch(output_dir, path, manifest)
        return path
    latest = find_latest_checkpoint(path)
    if latest is None:
        raise CheckpointError(_nothing_to_resume(path))
    return latest


def _refuse_a_branch(output_dir: Path, checkpoint: Path, manifest: dict) -> None:
    """Refuse to resume in `checkpoint`'s own folder when lstune's later checkpoints are there.

    Continuing from an earlier step there would mix two histories: `_prune` keeps by step, so the run's
    new checkpoints (and the one it resumed from) would be pruned while the abandoned run's later ones
    stay, those would be replaced as the new run reaches their steps, and a later `--resume` would
    continue whichever is highest. Checked before anything is written; resuming into another folder
    leaves this one alone, so it is always allowed (outputs.py checks that folder holds no other run).
    """
    if checkpoint.resolve().parent != output_dir.resolve():
        return
    later = _later_checkpoints(output_dir, _step_of(checkpoint, manifest))
    if later:
        names = ", ".join(path.name for path in later)
        raise CheckpointError(
            f"Cannot resume from {checkpoint} in {output_dir}: it is not the newest checkpoint there ({names} "
            f"came later), and continuing in the same folder would mix two histories (pruning by step would "
            f"delete this run's checkpoints and keep the later ones, which a later --resume would continue). "
            + _branch_fixes(checkpoint, later)
        )


def _branch_fixes(checkpoint: Path, later: list[Path]) -> str:
    """The two ways to resume from `checkpoint` when `later` checkpoints share its folder."""
    names = ", ".join(path.name for path in later)
    return (
        f"Continue from {checkpoint.name} in a new folder (--resume {checkpoint} --output-dir NEW_FOLDER), "
        f"or move {names} out of {checkpoint.parent} and resume from {checkpoint.name} there."
    )


def _step_of(checkpoint: Path, manifest: dict) -> int | None:
    """The step lstune orders checkpoints by: the folder name's, else (a renamed folder) the manifest's."""
    match = _CHECKPOINT_RE.match(checkpoint.name)
    if match:
        return int(match.group(1))
    step = manifest.get("step")
    return step if isinstance(step, int) else None


def _later_checkpoints(output_dir: Path, step: int | None) -> list[Path]:
    """lstune's checkpoints in `output_dir` (complete or not: none may be lost) after `step`, oldest first.

    Folders named like a checkpoint without lstune's manifest are not counted: lstune never touches them.
    """
    if step is None:
        return []
    return [path for number, path in reversed(_checkpoint_dirs(output_dir)) if number > step and _is_ours(path)]


# ----------------------------------------------------------------------------------------------------
# Saving


class _Save:
    """The folders and steps of one save; each step runs on every rank through `on_all_ranks`."""

    def __init__(self, output_dir: Path, step: int, token: str, comm: Communicator):
        self.output_dir, self.step, self.comm = output_dir, step, comm
        self.tmp = output_dir / f".tmp-checkpoint-{step}-{token}"
        self.aside = output_dir / f".old-checkpoint-{step}-{token}"
        self.final = output_dir / f"checkpoint-{step}"

    def on_all_ranks(self, fn: Callable[[], Any]) -> list:
        """Run `fn` on every rank; if it fails anywhere, remove the temporary folder and raise everywhere.

        Returns every rank's result. Without this agreement a rank that failed would leave the others
        waiting forever in the next collective.
        """
        try:
            outcome = (None, fn())
        except Exception as exc:  # noqa: BLE001 - re-raised below, after the other ranks hear of it
            if self.comm.size == 1:
                self._remove_tmp()
                raise
            outcome = (f"{type(exc).__name__}: {exc}", None)
            local_error = exc
        except BaseException:
            self._remove_tmp()
            raise
        else:
            local_error = None
        outcomes = self.comm.gather(outcome)
        failures = {rank: error for rank, (error, _) in enumerate(outcomes) if error is not None}
        if failures:
            self._remove_tmp()
            if local_error is not None:
                raise local_error
            raise RuntimeError(f"{self.final.name} was not saved: {_describe_failures(failures)}")
        return [result for _, result in outcomes]

    def prepare(self) -> None:
        """Rank 0: refuse to replace what is not ours, clear stale folders, create the temporary one."""
        if self.final.exists() and not _is_ours(self.final):
            raise CheckpointError(
                f"{self.final} exists and is not an lstune checkpoint (it has no {MANIFEST_NAME}); "
                f"refusing to replace it. Move it away or choose another output folder."
            )
        self.output_dir.mkdir(parents=True, exist_ok=True)
        _clean_stale(self.output_dir)
        self.tmp.mkdir()

    def write(self, write_state: Callable[[Path], None], state_json: str) -> None:
        """Every rank: the engine's files, then lstune's own (exclusive create: never overwrite them)."""
        import torch

        from lstune.train.rng import capture_rng_state

        write_state(self.tmp)
        if self.comm.rank == 0:
            with open(self.tmp / TRAINER_STATE_NAME, "x") as f:
                f.write(state_json)
        with open(self.tmp / rng_state_name(self.comm.rank, self.comm.size), "xb") as f:
            torch.save(capture_rng_state(), f)

    def publish(self, hashes: dict[str, dict], keep_last: int | None) -> None:
        """Rank 0: manifest last, fsync, rename into place (replacing an older copy safely), prune."""
        for folder, _, _ in os.walk(self.tmp, topdown=False):
            fsync_dir(Path(folder))
        manifest = {
            "format": FORMAT_NAME,
            "version": FORMAT_VERSION,
            "step": self.step,
            "world_size": self.comm.size,
            "created_unix": time.time(),
            "files": [{"path": p, **hashes[p]} for p in sorted(hashes)],
        }
        with open(self.tmp / MANIFEST_NAME, "x") as f:
            json.dump(manifest, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        apply_umask(self.tmp)
        fsync_dir(self.tmp)
        self._rename_into_place()
        _prune(self.output_dir, self.final, keep_last)

    def _rename_into_place(self) -> None:
        replaced = self.final.exists()
        if replaced:
            if not _is_ours(self.final):
                raise CheckpointError(
                    f"{self.final} appeared during the save and is not an lstune checkpoint; refusing to "
                    f"replace it. Move it away or choose another output folder."
                )
            os.rename(self.final, self.aside)
        os.rename(self.tmp, self.final)
        fsync_dir(self.output_dir)
        if replaced:
            shutil.rmtree(self.aside)

    def _remove_tmp(self) -> None:
        if self.comm.rank == 0:
            shutil.rmtree(self.tmp, ignore_errors=True)


def _train_state_json(step: int, train_state: dict) -> str:
    if train_state.get("step", step) != step:
        raise ValueError(f"train_state['step'] is {train_state['step']!r} but the checkpoint step is {step}")
    return json.dumps({**train_state, "step": step}, indent=2)


def _list_files(root: Path) -> list[str]:
    """Every file under `root` except the manifest, as sorted POSIX paths relative to `root`."""
    found = []
    for folder, _, names in os.walk(root):
        for name in names:
            relative = (Path(folder) / name).relative_to(root).as_posix()
            if relative != MANIFEST_NAME:
                found.append(relative)
    return sorted(found)


def _clean_stale(output_dir: Path) -> None:
    """Delete temporary folders of crashed saves; put back an old copy whose replacement never landed."""
    for entry in output_dir.iterdir():
        match = _STALE_RE.match(entry.name)
        if match is None or entry.is_symlink() or not entry.is_dir():
            continue
        kind, step = match.group(1), match.group(2)
        final = output_dir / f"checkpoint-{step}"
        if kind == "old" and not final.exists():
            logger.warning("restoring %s from %s (a save was interrupted while replacing it)", final, entry)
            os.rename(entry, final)
        else:
            logger.info("removing %s, left by an interrupted save", entry)
            shutil.rmtree(entry)


def _prune(output_dir: Path, just_written: Path, keep_last: int | None) -> None:
    """Keep `just_written` and the newest `keep_last - 1` other complete checkpoints; delete our others."""
    if keep_last is None:
        return
    ours = [path for _, path in _checkpoint_dirs(output_dir) if path != just_written and _is_ours(path)]
    complete = [path for path in ours if not _problems(path, verify_hashes=False)]
    keep = set(complete[: keep_last - 1])
    for path in ours:
        if path not in keep:
            logger.info("removing %s (keeping the last %d checkpoints)", path, keep_last)
            _remove_checkpoint(path)


def _remove_checkpoint(path: Path) -> None:
    """Rename, then delete: a crash mid-delete leaves a `.pruned-` folder (removed by the next save's
    stale-folder pass), never a `checkpoint-N` folder with part of its files or without its manifest."""
    doomed = path.with_name(f".pruned-{path.name}-{secrets.token_hex(4)}")
    os.rename(path, doomed)
    fsync_dir(path.parent)
    shutil.rmtree(doomed)


# ----------------------------------------------------------------------------------------------------
# Hashing


def _hash_file(path: Path, fsync: bool) -> dict:
    """Size and sha256 of one file, streamed in 8 MiB blocks so multi-GB shards need no memory."""
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while block := f.read(_HASH_BLOCK_BYTES):
            digest.update(block)
            size += len(block)
        if fsync:
            # fsync flushes the file's dirty pages whichever descriptor asks; the hashing rank does it
            # so every file is flushed exactly once, including files another local rank wrote.
            os.fsync(f.fileno())
    return {"size": size, "sha256": digest.hexdigest()}


def _hash_share(root: Path, files: list[str], comm: Communicator, *, fsync: bool) -> dict[str, dict]:
    """Hash this rank's share of `files` (every size-th one) on a few threads (hashlib releases the GIL)."""
    share = files[comm.rank :: comm.size]
    if not share:
        return {}
    with ThreadPoolExecutor(max_workers=min(_HASH_THREADS, len(share))) as pool:
        results = pool.map(lambda name: _hash_file(root / name, fsync), share)
        return dict(zip(share, results))


def _merge(per_rank: list[dict[str, dict]]) -> dict[str, dict]:
    merged: dict[str, dict] = {}
    for part in per_rank:
        merged.update(part)
    return merged


def _log_hashing(verb: str, path: Path, files: list[str], started: float) -> None:
    if files:
        logger.info("%s %s: hashed %d files in %.1f s", verb, path, len(files), time.perf_counter() - started)


# ----------------------------------------------------------------------------------------------------
# Validation


class _Invalid(Exception):
    """Why a folder is not a usable checkpoint, as short phrases (turned into `CheckpointError`)."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("; ".join(problems))


def _validate(path: Path, verify_hashes: bool, comm: Communicator) -> dict:
    try:
        return _check(path, verify_hashes, comm)
    except _Invalid as invalid:
        raise _checkpoint_error(path, invalid.problems) from None


def _check(path: Path, verify_hashes: bool, comm: Communicator) -> dict:
    """The manifest of a usable checkpoint; raises `_Invalid` listing every problem found."""
    manifest = _read_manifest(path)
    problems = _unlisted_problems(path, manifest) + _size_problems(path, manifest)
    if not problems and verify_hashes:  # hashing reads every byte: only worth it when sizes match
        problems = _hash_problems(path, manifest, comm)
    if problems:
        raise _Invalid(problems)
    return manifest


def _problems(path: Path, *, verify_hashes: bool) -> list[str]:
    """[] for a usable checkpoint, else why not (single process; used to list and pick checkpoints)."""
    try:
        _check(path, verify_hashes, Communicator())
    except _Invalid as invalid:
        return invalid.problems
    return []


def _read_manifest(path: Path) -> dict:
    if not path.is_dir():
        raise _Invalid(["it does not exist" if not path.exists() else "it is not a folder"])
    manifest_path = path / MANIFEST_NAME
    if not manifest_path.is_file():
        raise _Invalid(
            [f"it has no {MANIFEST_NAME}: its save was interrupted (a partial checkpoint), "
             f"or it was not written by lstune"]
        )
    try:
        manifest = read_json(manifest_path, error=CheckpointError, expect=object)
    except CheckpointError as exc:
        raise _Invalid([f"its {MANIFEST_NAME} is unreadable (corrupt): {exc}"]) from None
    _check_manifest_shape(manifest)
    return manifest


def _check_manifest_shape(manifest: Any) -> None:
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_NAME:
        raise _Invalid([f"its {MANIFEST_NAME} is not an lstune checkpoint manifest (corrupt)"])
    version = manifest.get("version")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise _Invalid(
            [f"it was written in checkpoint format version {version!r}, and this lstune reads up to "
             f"version {FORMAT_VERSION}: upgrade lstune to load it"]
        )
    files = manifest.get("files")
    if not isinstance(files, list) or not all(_is_file_entry(entry) for entry in files):
        raise _Invalid([f"its {MANIFEST_NAME} has a malformed file list (corrupt)"])
    if not any(entry["path"] == TRAINER_STATE_NAME for entry in files):
        raise _Invalid([f"its {MANIFEST_NAME} does not list {TRAINER_STATE_NAME}, which every lstune checkpoint "
                        "holds (corrupt or crafted)"])


def _is_file_entry(entry: Any) -> bool:
    if not isinstance(entry, dict) or not isinstance(entry.get("path"), str):
        return False
    relative = Path(entry["path"])
    inside = not relative.is_absolute() and ".." not in relative.parts
    return inside and isinstance(entry.get("size"), int) and isinstance(entry.get("sha256"), str)


def _unlisted_problems(path: Path, manifest: dict) -> list[str]:
    """Files (and links) in the checkpoint that its manifest does not list: a loader may read any file of the
    folder (DeepSpeed globs its shards), so each must be one the manifest verifies. A link is refused wherever
    it points: what it reaches is outside the manifest's hashes."""
    listed = {entry["path"] for entry in manifest["files"]} | {MANIFEST_NAME}
    problems = []
    for folder, dirs, names in os.walk(path):
        for name in sorted(dirs + names):
            entry = Path(folder) / name
            relative = entry.relative_to(path).as_posix()
            if entry.is_symlink():
                problems.append(f"{relative} is a symbolic link; a checkpoint holds only files its manifest lists")
            elif name in names and relative not in listed:
                problems.append(f"{relative} is not listed in its {MANIFEST_NAME} (added after the save, or crafted)")
        dirs[:] = [d for d in dirs if not (Path(folder) / d).is_symlink()]
    return problems


def _size_problems(path: Path, manifest: dict) -> list[str]:
    problems = []
    for entry in manifest["files"]:
        file = path / entry["path"]
        if not file.is_file():
            problems.append(f"{entry['path']} is missing (its manifest lists it)")
        elif (size := file.stat().st_size) != entry["size"]:
            problems.append(
                f"{entry['path']} is {size} bytes but its manifest records {entry['size']} "
                f"(truncated or overwritten)"
            )
    return problems


def _hash_problems(path: Path, manifest: dict, comm: Communicator) -> list[str]:
    files = [entry["path"] for entry in manifest["files"]]
    actual = _merge(comm.gather(_hash_share(path, files, comm, fsync=False)))
    return [
        f"{entry['path']} does not match the sha256 in its manifest (the file is corrupt)"
        for entry in manifest["files"]
        if actual[entry["path"]]["sha256"] != entry["sha256"]
    ]


def _checkpoint_error(path: Path, problems: list[str]) -> CheckpointError:
    lines = [f"Checkpoint {path} cannot be loaded:"] + [f"  - {p}" for p in problems]
    return CheckpointError("\n".join(lines + [_earlier_checkpoints_hint(path)]), problems=problems)


def _earlier_checkpoints_hint(path: Path) -> str:
    """The newest other checkpoint beside `path` that passes the checks `load_checkpoint` makes, hashes
    included (a size check alone would recommend a checkpoint whose resume then fails its sha256).

    Newest first, stopping at the first that verifies: one full read besides the ones that fail.
    """
    checked = []
    for step, other in _checkpoint_dirs(path.parent):
        if other.resolve() == path.resolve():
            continue
        if not _problems(other, verify_hashes=True):
            return _resume_instead(other, step)
        checked.append(other.name)
    if not checked:
        return f"No other complete checkpoint is in {path.parent}; start the run again without resuming."
    return (
        f"No other checkpoint in {path.parent} verifies either ({', '.join(checked)}); start the run again "
        f"without resuming."
    )


def _resume_instead(good: Path, step: int) -> str:
    """How to resume from `good`, the newest checkpoint that verifies: directly when it is the newest of
    lstune's checkpoints in its folder, else in one of the ways `_refuse_a_branch` allows."""
    later = _later_checkpoints(good.parent, step)
    if not later:
        return f"Resume from another complete checkpoint in {good.parent} instead: {good.name}."
    return (
        f"The newest other checkpoint in {good.parent} that verifies is {good.name}, but later checkpoints "
        f"are there. " + _branch_fixes(good, later)
    )


def _nothing_to_resume(output_dir: Path) -> str:
    if not output_dir.is_dir():
        return f"Nothing to resume: {output_dir} does not exist. Start without resuming, or check the path."
    found = [
        f"{path.name} ({'; '.join(_problems(path, verify_hashes=False))})"
        for _, path in _checkpoint_dirs(output_dir)
    ]
    found += [
        f"{entry.name} (a save that was interrupted)"
        for entry in sorted(output_dir.iterdir())
        if _STALE_RE.match(entry.name) and entry.name.startswith(".tmp-")
    ]
    what = "found only: " + ", ".join(found) if found else "it holds no checkpoint-STEP folder"
    return (
        f"Nothing to resume in {output_dir}: no complete checkpoint; {what}. "
        f"Start without resuming, or pass the path of a complete checkpoint folder."
    )


# ----------------------------------------------------------------------------------------------------
# Folders and reading


def _checkpoint_dirs(output_dir: Path) -> list[tuple[int, Path]]:
    """`checkpoint-N` folders in `output_dir`, highest step first."""
    if not output_dir.is_dir():
        return []
    found = [
        (int(match.group(1)), entry)
        for entry in output_dir.iterdir()
        if (match := _CHECKPOINT_RE.match(entry.name)) and entry.is_dir()
    ]
    return sorted(found, key=lambda item: item[0], reverse=True)


def _is_ours(path: Path) -> bool:
    """A real folder (not a link) holding our manifest: the only kind this module replaces or deletes."""
    return path.is_dir() and not path.is_symlink() and (path / MANIFEST_NAME).is_file()


def _read_rng_state(path: Path, manifest: dict, comm: Communicator) -> dict | None:
    from lstune.untrusted import torch_load

    saved_world = manifest.get("world_size", 1)
    if saved_world != comm.size:
        logger.warning(
            "%s was saved by %d process(es) and is loaded by %d: random states are not restored, so "
            "random draws differ from an uninterrupted run",
            path,
            saved_world,
            comm.size,
        )
        return None
    return torch_load(path / rng_state_name(comm.rank, comm.size), error=CheckpointError)


# ----------------------------------------------------------------------------------------------------
# Ranks


def _describe_failures(failures: dict[int, str]) -> str:
    return "; ".join(f"rank {rank} failed: {error}" for rank, error in sorted(failures.items()))
