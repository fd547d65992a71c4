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
    from lstune.train.outputs import holds_a_run

    output_dir = Path(config.output_dir)
    if output_dir.exists() and (not output_dir.is_dir() or holds_a_run(output_dir)):
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


def check_sizes(config: TrainConfig, model_config, runtime) -> None:
    """Refuse sizes that cannot fit before any data or weights are loaded.

    The bound is deliberately simple and only a lower one: every decoder layer's input, one hidden state
    of micro_batch × (seq_len / sp) × hidden in the compute dtype, must exist at once on the device (on
    CPU: in host RAM). A run over it cannot work; a run under it may still not fit. The full memory
    estimate (`lstune estimate`) is the finer check where it is available.
    """
    hidden = getattr(model_config, "hidden_size", None) or getattr(model_config, "n_embd", None)
    if not hidden:
        return
    sp = runtime.sp
    bytes_per_value = 2 if runtime.autocast_dtype is not None else 4
    tokens = config.micro_batch_size * -(-config.seq_len // sp)
    needed = tokens * hidden * bytes_per_value
    available, where = _device_memory(runtime)
    if needed > available:
        raise ConfigError([
            f"--micro-batch-size {config.micro_batch_size} × --seq-len {config.seq_len:,} cannot fit: one hidden "
            f"state of {tokens:,} tokens × {hidden} × {bytes_per_value} bytes is {needed / 2**30:,.1f} GiB, more than "
            f"the {available / 2**30:,.1f} GiB of {where} (a lower bound: training needs several times that). "
            "Lower --seq-len or --micro-batch-size, or add processes for sequence parallelism."
        ])


def _device_memory(runtime) -> tuple[int, str]:
    if runtime.device.type == "cuda":
        import torch

        return torch.cuda.get_device_properties(runtime.device).total_memory, f"memory on {runtime.device}"
    import os

    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "host RAM"


# Settings that fix the shape of the saved state: a checkpoint cannot be loaded under other values.
_RESUME_FIXED = {
    "model": "the model it was trained from",
    "lora_r": "the LoRA rank (0 = full fine-tune)",
    "lora_targets": "the modules LoRA adapts",
}


def check_resume_compatible(config: TrainConfig, checkpoint: Path, world_size: int) -> None:
    """Refuse, from the checkpoint's own records and before any weights load, a resume that cannot load:
    another model, LoRA added to or removed from a run, a DeepSpeed checkpoint under another world size."""
    import json

    from lstune.train.checkpoint import MANIFEST_NAME, TRAINER_STATE_NAME

    try:
        saved = json.loads((checkpoint / TRAINER_STATE_NAME).read_text(encoding="utf-8")).get("config") or {}
        manifest = json.loads((checkpoint / MANIFEST_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError, AttributeError):
        return  # load_checkpoint reports an unreadable checkpoint with its own message
    current = config.to_dict()
    problems = [
        f"--{key.replace('_', '-')} is {current.get(key)!r} but {checkpoint} was trained with {saved[key]!r} "
        f"({meaning}); resume with --{key.replace('_', '-')} {saved[key]}, or start a new run without --resume."
        for key, meaning in _RESUME_FIXED.items()
        if key in saved and not _same_setting(key, saved[key], current.get(key))
    ]
    if (checkpoint / "deepspeed").is_dir() and manifest.get("world_size", world_size) != world_size:
        problems.append(
            f"{checkpoint} is a DeepSpeed checkpoint written by {manifest['world_size']} processes and this run has "
            f"{world_size}; resume with --gpus {manifest['world_size']} (DeepSpeed's shards are per process)."
        )
    if problems:
        raise ConfigError(problems)


def _same_setting(key: str, saved, current) -> bool:
    if key == "model" and isinstance(saved, str) and isinstance(current, str):
        if Path(saved).exists() and Path(current).exists():
            return Path(saved).resolve() == Path(current).resolve()
    return saved == current
