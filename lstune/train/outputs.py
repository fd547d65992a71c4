"""The output folder: checked before anything heavy, created by the main process, never clobbered.

Nothing is overwritten unasked: an existing, non-empty folder is an error unless the run resumes there or
`--overwrite` is given — and then only lstune's own files are removed.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

from lstune.config.schema import RunSection
from lstune.errors import UserError

FINAL_DIR = "final"
MERGED_DIR = "final-merged"
CONFIG_FILE = "config.yaml"
OWN_ENTRIES = (".tmp-", ".old-checkpoint-", FINAL_DIR, MERGED_DIR, "metrics.jsonl", CONFIG_FILE)


def resolve_output_dir(run: RunSection, model_name: str) -> tuple[Path, Path | None]:
    """The output folder and the checkpoint to resume from; read-only, so every rank may call it."""
    from lstune.train.checkpoint import resolve_resume

    output_dir = Path(run.output_dir) if run.output_dir else default_output_dir(model_name)
    if run.resume:
        return output_dir, resolve_resume(output_dir, run.resume)
    problems = run.output_dir_problems(output_dir)
    if problems:
        raise UserError(problems[0])
    return output_dir, None


def create_output_dir(output_dir: Path, *, overwrite: bool) -> None:
    """Make the folder (after clearing our own files with --overwrite) and prove it is writable."""
    if overwrite and output_dir.is_dir():
        _clear_own_files(output_dir)
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
        probe = output_dir / ".lstune-write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise UserError(
            f"--output-dir {str(output_dir)!r} is not writable ({exc.strerror}); choose a folder you can write to."
        ) from None


def default_output_dir(model_name: str) -> Path:
    name = Path(model_name).name.lower().replace(":", "-")
    return Path("runs") / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"


def _clear_own_files(output_dir: Path) -> None:
    """Remove what an earlier lstune run wrote here; checkpoints only when they carry our manifest."""
    from lstune.train.checkpoint import MANIFEST_NAME

    for entry in output_dir.iterdir():
        ours = entry.name.startswith(OWN_ENTRIES) or (
            entry.name.startswith("checkpoint-") and (entry / MANIFEST_NAME).is_file()
        )
        if ours:
            shutil.rmtree(entry) if entry.is_dir() else entry.unlink()


def write_config_snapshot(output_dir: Path, view: dict) -> None:
    import yaml

    from lstune import __version__

    header = f"# resolved config written by lstune {__version__}; rerun with: lstune train --config {CONFIG_FILE}\n"
    (output_dir / CONFIG_FILE).write_text(header + yaml.safe_dump(view, sort_keys=False))
