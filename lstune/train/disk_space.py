"""Room on the output folder's disk for what a run saves, checked before it trains.

A save that does not fit fails cleanly (lstune.train.outputs.write_errors: nothing half-written, the newest
checkpoint intact), but only when it comes: after the first --save-every steps, maybe hours in. The estimate knows
the least a checkpoint takes (lstune.estimate.memory.saved_checkpoint_min_bytes: the trainable parameters' fp32
weights and AdamW's two moments; Llama-3.1-8B's full fine-tune: 89.7 GiB) and the least its final model takes
(final_model_min_bytes), so a disk that cannot hold one checkpoint is refused before the weights load, and one that
cannot hold what the run will have there at once is said at the start: the checkpoints --keep-last keeps beside the
one being written, then the final model beside those kept (how many it saves is known once its data is). Only the
main process reads the disk (the output folder is on its file system; several nodes share it); every rank gets its
answer.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from lstune.errors import ConfigError


def check_disk_space(config, params, runtime, folder, output_dir: Path, *, resume_from: Path | None,
                     max_steps: int) -> str | None:
    """ConfigError (exit 2) when one checkpoint of the run does not fit --output-dir's disk and --force is not
    given; otherwise the warning to show (None when there is room for the checkpoints the run saves, as
    --keep-last keeps them, and for its final model). `params`: the estimate's ParamCounts; `folder`: the main
    process's OutputFolder (None on the other ranks, which take its answer)."""
    from lstune.estimate.memory import final_model_min_bytes

    answer = None
    if runtime.is_main:
        from lstune.train.outputs import manifest_checkpoints

        run = config.run
        # The final model is written unless --stop-at-step stops the run first (lstune.train.run's loop).
        exports = run.stop_at_step is None or run.stop_at_step > max_steps
        cleared = folder.to_clear()  # --overwrite's: its checkpoints go, and their bytes are free for this run
        answer = disk_answer(output_dir, params, saves=planned_saves(run, resume_from, max_steps),
                             keep_last=run.keep_last or 0,
                             final=final_model_min_bytes(params, merge_lora=config.model.merge_lora) if exports else 0,
                             freed=_bytes_of(output_dir, cleared),
                             kept=0 if cleared else len(manifest_checkpoints(Path(output_dir))))
    problem, warning = runtime.comm.broadcast(answer)
    if problem is not None and not config.run.force:
        raise ConfigError([problem])
    return warning if problem is None else f"warning (--force): {problem}"


def planned_saves(run, resume_from: Path | None, max_steps: int) -> int:
    """The checkpoints a run saves from its start (0, or the step of the checkpoint it resumes) to `max_steps`:
    every --save-every steps before the last, and one at the end (at --stop-at-step when that comes first), as
    lstune.train.run's loop saves them."""
    from lstune.train.checkpoint import saved_step

    start = (saved_step(resume_from) or 0) if resume_from is not None else 0
    end = min(max_steps, run.stop_at_step) if run.stop_at_step is not None else max_steps
    if end <= start:
        return 0
    periodic = (end - 1) // run.save_every - start // run.save_every if run.save_every else 0
    return periodic + 1


def disk_answer(output_dir: Path, params, *, saves: int, keep_last: int, final: int = 0, freed: int = 0,
                kept: int = 0) -> tuple[str | None, str | None]:
    """(problem, warning) for `saves` checkpoints saved into `output_dir` under --keep-last `keep_last` (0 keeps
    all), then a final model of `final` bytes: `freed`, the bytes --overwrite removes before the first save;
    `kept`, the checkpoints of an earlier run there that stay (a resumed run's), which pruning removes as the new
    ones come."""
    from lstune.estimate.memory import saved_checkpoint_min_bytes, size_text

    need = saved_checkpoint_min_bytes(params)
    free = free_bytes(output_dir)
    if free is None or need <= 0:
        return None, None  # a file system that does not say: the save's own error stays the guard
    free += freed
    where = f"--output-dir {str(output_dir)!r} has {size_text(free)} free on its disk"
    what = f"(the fp32 weights and AdamW's two moments of its {params.trainable:,} trainable parameters)"
    if saves and free < need:
        return (f"{where}, and a checkpoint of this run takes at least {size_text(need)} {what}: its first save "
                "would fail. Free space there or give an --output-dir on a disk with room (--force trains anyway).",
                None)
    # At its i-th save the folder holds min(kept + i - 1, keep_last) earlier checkpoints and the one being written;
    # at the end, the checkpoints kept and the final model.
    limit = keep_last or kept + saves
    at_once = max(1, min(kept + saves - 1, limit) + 1 - kept) if saves else 0
    at_end = max(0, min(kept + saves, limit) - kept)
    needed = max(at_once * need, at_end * need + final)
    if free >= needed:
        return None, None
    keeping = f"--keep-last {keep_last} keeps" if keep_last else "--keep-last 0 keeps all of them, so"
    then = f"; its final model takes at least {size_text(final)} more at the end" if final else ""
    return None, (f"warning: {where}, and this run needs at least {size_text(needed)} there: it saves {saves} "
                  f"checkpoint(s) of at least {size_text(need)} each {what}, and {keeping} up to {at_once} at "
                  f"once with the one being written{then}. "
                  "A later save or the final export will fail (the run stops there, its newest checkpoint intact). "
                  "Free space, lower --keep-last, or give an --output-dir on a disk with room.")


def free_bytes(path: Path) -> int | None:
    """Bytes free to this user on `path`'s file system (None when it does not say)."""
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def _bytes_of(output_dir: Path, names) -> int:
    """Bytes of the entries `names` in `output_dir` (files and folders, links not followed)."""
    total = 0
    for name in names:
        path = Path(output_dir) / name
        if path.is_symlink() or not path.exists():
            continue
        if path.is_file():
            total += path.stat().st_size
            continue
        for root, _, files in os.walk(path):
            total += sum(os.lstat(os.path.join(root, f)).st_size for f in files)
    return total
