"""Checks that need no model or data loaded: run before anything heavy, every problem reported at once.

The rules about the config's own values live with its sections (`TrainConfig.problems()`); these look
outside it: does the model name resolve, does the data source exist.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

from lstune.config.schema import DEFAULT_SHUFFLE_BUFFER, TrainConfig
from lstune.errors import ConfigError, UserError


def preflight_problems(config: TrainConfig, *, weights: bool = True) -> list[str]:
    """Every problem found with the model source (its weights too unless `weights` is False: `lstune data` reads
    only the tokenizer) and the data source. Imports nothing heavy: these answer before any estimate or load."""
    problems: list[str] = []
    for check in (partial(_check_model, weights=weights), _check_data, check_metp_mlp_trainable):
        try:
            check(config)
        except UserError as exc:
            problems.extend(exc.problems)
    from lstune.train.tracking import missing_trackers

    return problems + missing_trackers(config.run.trackers())


def check_metp_mlp_trainable(config: TrainConfig) -> None:
    """--metp-mlp shards the MLP over the SP group and trains the shards beside DeepSpeed's engine
    (lstune.parallel.local_params): it needs SP > 1 (an SP degree that resolves to 1 is refused when the model is
    prepared, lstune.train.prepare)."""
    parallel = config.parallel
    if parallel.metp_mlp and parallel.sp == 1:
        raise ConfigError(["--metp-mlp shards the MLP over the SP group, and --sp 1 has none: give --sp N (N > 1), "
                           "or drop --metp-mlp."])


def _check_model(config: TrainConfig, *, weights: bool) -> None:
    from lstune.models.loading import check_local_files, resolve_source

    check_local_files(resolve_source(config.model.name), config.model.init if weights else "random")


def _check_data(config: TrainConfig) -> None:
    from lstune.data.sources import check_source, mixture_entries
    from lstune.data.templates import check_chat_template

    if config.data.problems():
        return  # a malformed --data is reported by its section
    if config.data.source is not None:
        for source, _ in mixture_entries(config.data.source):
            check_source(source, split=config.data.data_split, subset=config.data.data_subset)
    if config.data.eval_data is not None:
        check_source(config.data.eval_data)
    check_chat_template(config.data.chat_template)


# Settings that fix the shape of the saved state: a checkpoint cannot be loaded under other values.
_RESUME_FIXED = {
    "model": "the model it was trained from",
    "lora_r": "the LoRA rank (0 = full fine-tune)",
    "lora_targets": "the modules LoRA adapts",
    # The checkpoint's count of consumed samples is a position in a stream or in the map-style order, not both.
    "data_streaming": "how --data is read, whose position the checkpoint records",
}


def check_resume_compatible(config: TrainConfig, checkpoint: Path, world_size: int) -> None:
    """Refuse, from the checkpoint's own records and before any weights load, a resume that cannot load:
    another model, LoRA added to or removed from a run, a DeepSpeed checkpoint under another world size."""
    from lstune.train.checkpoint import read_train_state, validate_checkpoint

    manifest = validate_checkpoint(checkpoint, verify_hashes=False)  # the hashes are checked as it loads
    state = read_train_state(checkpoint)
    saved = state.get("config") or {}
    current = config.to_dict()
    problems = [
        f"--{key.replace('_', '-')} is {current.get(key)!r} but {checkpoint} was trained with {saved[key]!r} "
        f"({meaning}); resume with {_as_flag(key, saved[key])}, or start a new run without --resume."
        for key, meaning in _RESUME_FIXED.items()
        if key in saved and not _same_setting(key, saved[key], current.get(key))
    ]
    if (checkpoint / "deepspeed").is_dir() and manifest.get("world_size", world_size) != world_size:
        problems.append(
            f"{checkpoint} is a DeepSpeed checkpoint written by {manifest['world_size']} processes and this run has "
            f"{world_size}; resume with --gpus {manifest['world_size']} (DeepSpeed's shards are per process)."
        )
    problems += _zero_stage_problems(config, checkpoint)
    problems += _stream_order_problems(config, checkpoint, state)
    if problems:
        raise ConfigError(problems)


def stream_order(config: TrainConfig) -> dict | None:
    """What fixes --data-streaming's sample order besides the data (a checkpoint records it: `stream_order` in its
    train state); None for map-style data (a change of its seed on resume is allowed and said)."""
    if not config.data.data_streaming:
        return None
    return {"seed": config.optim.seed, "shuffle_buffer": config.data.shuffle_buffer()}


def _stream_order_problems(config: TrainConfig, checkpoint: Path, state: dict) -> list[str]:
    """A streamed run resumes by replaying the stream and dropping the samples it consumed (docs/data.md): under
    another seed or shuffle buffer the replay is another order, and the resumed run would silently train on other
    samples than the interrupted one would have. Checkpoints from before the order was recorded: from their config."""
    current = stream_order(config)
    saved_config = state.get("config") or {}
    if current is None or not saved_config.get("data_streaming"):
        return []  # map-style data, or a change of --data-streaming (refused above)
    saved = state.get("stream_order")
    if not isinstance(saved, dict):
        buffer = saved_config.get("data_shuffle_buffer")
        buffer = DEFAULT_SHUFFLE_BUFFER if buffer is None else buffer
        saved = {"seed": saved_config.get("seed"), "shuffle_buffer": buffer}
    flags = {"seed": "--seed", "shuffle_buffer": "--data-shuffle-buffer"}
    return [
        f"{flags[key]} is {current[key]} but {checkpoint} read its --data-streaming stream with {flags[key]} "
        f"{saved[key]}: the resumed stream would be in another order than the interrupted run's, not its "
        f"continuation; resume with {flags[key]} {saved[key]}, or start a new run without --resume."
        for key in flags if saved.get(key) is not None and saved.get(key) != current[key]
    ]


def check_resume_layout(checkpoint: Path, layout: dict) -> None:
    """Refuse a resume under another parallel layout than the checkpoint's (`Runtime.layout`: processes, SP, its ring
    part, METP's MLP, the attention chunks under a ring) when either uses a ring or METP's MLP: the zigzag pieces
    (cut per chunk under a ring) and METP's weight shards follow the layout, so only the same one continues the run
    exactly. Plain Ulysses / DP runs may still change it (as before: the random states are then not restored).
    Checkpoints from before layouts were recorded pass."""
    import json

    from lstune.train.checkpoint import TRAINER_STATE_NAME

    try:
        saved = json.loads((checkpoint / TRAINER_STATE_NAME).read_text(encoding="utf-8")).get("layout")
    except (OSError, ValueError, AttributeError):
        return
    if not saved or saved == layout:
        return
    if not any(side.get("ring", 1) > 1 or side.get("metp_mlp") for side in (saved, layout)):
        return
    names = {"world_size": "--gpus (processes)", "sp": "--sp", "ring": "--sp-ring", "metp_mlp": "--metp-mlp",
             "attn_chunks": "--attn-chunks"}
    keys = [*layout, *(k for k in saved if k not in layout)]
    differ = [f"{names.get(k, k)} {saved.get(k, 'off' if k == 'attn_chunks' else None)} (now "
              f"{layout.get(k, 'off' if k == 'attn_chunks' else None)})" for k in keys if saved.get(k) != layout.get(k)]
    raise ConfigError([f"{checkpoint} was written under another parallel layout: {', '.join(differ)}; resume with the "
                       "checkpoint's layout, or start a new run without --resume."])


def _zero_stage_problems(config: TrainConfig, checkpoint: Path) -> list[str]:
    """A DeepSpeed checkpoint resumed under another explicit --zero-stage (auto is checked once the engine's
    stage is chosen, `DeepSpeedEngine.load`)."""
    from lstune.errors import CheckpointError
    from lstune.parallel.engine_ds import DS_TAG, refuse_other_zero_stage

    stage = config.parallel.zero_stage
    if stage == "auto" or not (checkpoint / DS_TAG).is_dir():
        return []
    try:
        refuse_other_zero_stage(checkpoint, int(stage))
    except CheckpointError as exc:
        return [str(exc)]
    return []


def _as_flag(key: str, value) -> str:
    flag = key.replace("_", "-")
    if isinstance(value, bool):
        return f"--{flag}" if value else f"--no-{flag}"
    return f"--{flag} {value}"


def _same_setting(key: str, saved, current) -> bool:
    if key == "model" and isinstance(saved, str) and isinstance(current, str):
        if Path(saved).exists() and Path(current).exists():
            return Path(saved).resolve() == Path(current).resolve()
    return saved == current


NO_BASE_NOTE = "NO_BASE_MODEL.txt"  # written into OUTPUT_DIR/final beside an adapter that has no base to load


def adapter_without_base(config: TrainConfig, source_kind: str) -> str | None:
    """The warning for a LoRA run whose OUTPUT_DIR/final will hold an adapter with no loadable base: its base was
    randomly initialised (a preset, or --init random), so no saved weights exist that the adapter applies to.
    None when the run writes a loadable model (a full fine-tune, a pretrained base, or --merge-lora)."""
    model = config.model
    random_init = model.init == "random" or (model.init == "auto" and source_kind == "preset")
    if not model.lora_r or model.merge_lora or not random_init:
        return None
    return (f"warning: LoRA on a randomly initialised base ({model.name}): OUTPUT_DIR/final will hold only the "
            "adapter, and no saved weights exist for its base, so it cannot be loaded on its own. Add --merge-lora "
            "to also write the full model (OUTPUT_DIR/final-merged), or adapt a model with pretrained weights "
            f"(a hub id or a local folder, without --init random). {NO_BASE_NOTE} in final/ says so too.")
