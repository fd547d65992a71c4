"""Checks that need no model or data loaded: run before anything heavy, every problem reported at once."""

from __future__ import annotations

from pathlib import Path

from lstune.config.schema import TrainConfig
from lstune.errors import ConfigError, UserError


def preflight_problems(config: TrainConfig) -> list[str]:
    """Every problem found with the model source, the data source and the output folder."""
    problems: list[str] = []
    for check in (_check_model, _check_data, _check_output):
        try:
            check(config)
        except UserError as exc:
            problems.extend(exc.problems)
    return problems


def preflight(config: TrainConfig) -> None:
    problems = preflight_problems(config)
    if problems:
        raise ConfigError(problems)


def _check_model(config: TrainConfig) -> None:
    from lstune.models.loading import resolve_source

    resolve_source(config.model)


def _check_data(config: TrainConfig) -> None:
    from lstune.errors import DataError

    source = config.data
    if source.startswith("builtin:"):
        from lstune.data.sources import BUILTINS

        if source.removeprefix("builtin:") not in BUILTINS:
            bundled = ", ".join(f"builtin:{name}" for name in BUILTINS)
            raise DataError(f"--data {source!r} is not a bundled dataset; bundled: {bundled}.")
        return
    path = Path(source).expanduser()
    looks_local = path.suffix or source.startswith((".", "/", "~")) or source.count("/") > 1
    if looks_local and not path.exists():
        raise DataError(
            f"--data {source!r} does not exist; give a JSONL/JSON/Parquet/Arrow file or folder, a "
            "save_to_disk folder, a hub dataset name, or builtin:passkey."
        )


def _check_output(config: TrainConfig) -> None:
    if config.output_dir is None or config.resume or config.overwrite:
        return
    output_dir = Path(config.output_dir)
    if output_dir.exists() and (not output_dir.is_dir() or any(output_dir.iterdir())):
        raise UserError(
            f"--output-dir {config.output_dir!r} already exists and is not empty; nothing is overwritten unasked. "
            "Use --resume to continue that run, --overwrite to replace it, or another --output-dir."
        )


def check_parallel_layout(config: TrainConfig) -> None:
    """Before launching N processes: the SP degree must fit them and the model's heads (ConfigError lists
    the valid degrees). Multi-node runs learn their world size from the hostfile, so only --gpus is checked
    for a single node."""
    from lstune.models.loading import load_config, resolve_source
    from lstune.parallel.dims import ParallelDims

    if config.hostfile is not None:
        return
    model_config = load_config(resolve_source(config.model), trust_remote_code=config.trust_remote_code)
    ParallelDims.for_model(config.gpus, config.sp, model_config)
