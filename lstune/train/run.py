"""`train(config)`: a training run, from output folder to final model, on one device or many.

Setup is split into small steps — runtime (device, ranks) → output folder → model support check →
tokenizer → data → model → engine → resume — so that every cheap check runs before anything heavy.
The same code drives one process (plain AdamW) and a launched distributed run (DeepSpeed ZeRO, Ulysses
sequence parallelism): only `Runtime` and the engine differ.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lstune import __version__
from lstune.config.schema import TrainConfig
from lstune.errors import UserError
from lstune.train.outputs import (
    FINAL_DIR,
    MERGED_DIR,
    OutputFolder,
    check_overlaps,
    resolve_output_dir,
    write_config_snapshot,
)
from lstune.train.reporter import LogReporter, Reporter
from lstune.train.runtime import Runtime, start_runtime
from lstune.train.signals import StopOnSignal, holding_sigterm, note_checkpoint, raise_if_terminated
from lstune.train.signals import reset as reset_signals
from lstune.train.step import RunState, Stepper

log = logging.getLogger("lstune")


@dataclass
class TrainResult:
    output_dir: Path
    steps_done: int
    max_steps: int
    is_main: bool = True
    interrupted: bool = False
    stopped_early: bool = False
    final_dir: Path | None = None
    merged_dir: Path | None = None
    last_checkpoint: Path | None = None
    history: list[dict[str, Any]] = field(default_factory=list)


class _Silent:
    """The reporter of non-main ranks: the main process speaks for the run; they only log at debug level."""

    def start(self, plan):
        log.debug("plan: %s", plan)

    def note(self, text):
        log.debug("%s", text)

    def step(self, metrics):
        log.debug("step %s", metrics["step"])

    def end(self, result):
        log.debug("done")


def train(config: TrainConfig, reporter: Reporter | None = None) -> TrainResult:
    """Run the training `config` describes; returns when finished or stopped by a signal."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # lstune draws its own progress; HF's per-save bars are noise here
    reset_signals()
    runtime = start_runtime(config.model.dtype)
    reporter = (reporter or LogReporter()) if runtime.is_main else _Silent()
    opened: list = []  # the locked output folder, in hand from the moment it is locked (closed below, whatever comes)
    try:
        output_dir, resume_from, folder = _setup_output(config, runtime, opened)
        raise_if_terminated()  # a SIGTERM held back while the folder was being locked
        return _run(config, runtime, reporter, output_dir, resume_from, folder)
    finally:
        for folder in opened:
            folder.close()


def _run(config, runtime: Runtime, reporter, output_dir: Path, resume_from: Path | None, folder) -> TrainResult:
    from lstune.data.templates import set_chat_template
    from lstune.train.build import build
    from lstune.train.disk_space import check_disk_space
    from lstune.train.engine_choice import check_fits, prediction_note, runtime_cluster
    from lstune.train.plan import plan as make_plan
    from lstune.train.preflight import adapter_without_base, check_resume_compatible, check_resume_layout

    with runtime.decided_alike():  # every rank refuses alike what these check: one message, the main process's
        if resume_from is not None:
            check_resume_compatible(config, resume_from, runtime.world_size)
        run_plan = make_plan(config, runtime_cluster(runtime), runtime.device.type)
        runtime.use_dims(run_plan.dims)
        if resume_from is not None:
            check_resume_layout(resume_from, runtime.layout(config.parallel.metp_mlp, config.memory.attn_chunks))
        for note in run_plan.notes:
            reporter.note(note)
    no_base = adapter_without_base(config, run_plan.spec.source.kind)  # warned now, noted in final/ (`_export`)
    if no_base:
        reporter.note(no_base)
    # Rank 0's estimate for every rank: nodes with different host memory must not pick different engines or tile
    # counts (ZeRO-3 gathers weights once per tile, so the ranks' collectives would no longer match).
    run_plan = run_plan.with_estimate(runtime.comm.broadcast(run_plan.estimate))
    prediction = run_plan.estimate
    with runtime.decided_alike():
        check_fits(config, prediction, runtime)  # before any data or weights are loaded
    tokenizer, notes = _setup_tokenizer(config, run_plan.spec)
    template_note = set_chat_template(tokenizer, config.data.chat_template)
    notes += [template_note] if template_note else []
    with runtime.main_first():  # the main process fills the tokenized-data cache, the others read it
        dataset = _setup_data(config, tokenizer, run_plan.spec.config)
        dataset, eval_dataset = _setup_eval_data(config, tokenizer, run_plan.spec.config, dataset)
    raise_if_terminated()  # a SIGTERM whose exception was lost while loading (lstune.train.signals.on_sigterm)
    max_steps = total_steps(config, None if config.data.data_streaming else len(dataset), runtime.world_size)
    with runtime.decided_alike():  # room for the checkpoints it will save: before any weights load
        disk_note = check_disk_space(config, prediction.params, runtime, folder, output_dir,
                                     resume_from=resume_from, max_steps=max_steps)
    if disk_note:
        reporter.note(disk_note)
    reporter.note(prediction_note(prediction))  # the predicted peak, just before the weights load
    built = build(run_plan, runtime, max_steps=max_steps, tokenizer=tokenizer, notes=notes)
    loaded, prepared, engine = built.loaded, built.prepared, built.engine
    for note in runtime.notes + loaded.notes:
        reporter.note(note)
    warning = truncation_warning(dataset.summary())
    for note in built.notes:
        reporter.note(note)

    state = RunState()
    if resume_from is not None:
        state, saved_config = _resume(engine, resume_from)
        reporter.note(f"resumed from {resume_from} at step {state.step}")
        if state.step >= max_steps:
            reporter.note(f"the checkpoint is at step {state.step} of {max_steps}: nothing left to train (raise "
                          "--max-steps or --epochs to train on); the final model is written from it")
        changes = config_changes(saved_config, _recipe_view(config))
        if changes:
            reporter.note("resumed with settings that differ from the checkpoint's run; they take effect from "
                          "this step: " + "; ".join(changes))
    if folder is not None:
        folder.clear_previous()  # --overwrite: only now, with every check of the new run passed
        write_config_snapshot(folder, _recipe_view(config))

    reporter.start(_plan(config, loaded, prepared, dataset, max_steps, output_dir, runtime, state, run_plan.memory))
    if warning:
        reporter.note(warning)
    result = TrainResult(output_dir, state.step, max_steps, is_main=runtime.is_main)
    result.last_checkpoint = resume_from if resume_from is not None and resume_from.parent == output_dir else None
    evaluator = _make_evaluator(config, eval_dataset, prepared, runtime, reporter)
    _loop(config, built, dataset, runtime, state, result, reporter, folder, evaluator)
    if folder is not None and result.history:
        _plot(result, folder, reporter)
    mixture = _mixture_note(config, dataset, state.consumed_samples)
    if mixture:
        reporter.note(mixture)
    reporter.end(result)
    return result


def _setup_output(config: TrainConfig, runtime: Runtime, opened: list) -> tuple[Path, Path | None, OutputFolder | None]:
    """Every rank checks (read-only); then the main process creates and locks the folder (an error there,
    such as another run holding it, reaches every rank) before anything heavy is loaded. The locked folder goes
    into `opened` at once, a SIGTERM held back meanwhile (lstune.train.signals.holding_sigterm), so that the
    caller releases the lock whatever happens next."""
    output_dir, resume_from = resolve_output_dir(config.run, config.model.name)
    check_overlaps(output_dir, *_local_inputs(config))
    runtime.barrier()  # every rank has checked the folder before the main process writes into it
    folder, error = None, None
    if runtime.is_main:
        try:
            with holding_sigterm():
                folder = OutputFolder(output_dir).open(overwrite=config.run.overwrite and not config.run.resume,
                                                       writes=_extra_outputs(config))
                opened.append(folder)
        except UserError as exc:
            error = exc
    if runtime.any(error is not None):
        if error is not None:
            raise error
        raise UserError(f"the main process could not open --output-dir {str(output_dir)!r} (its message says why)")
    config.run.output_dir = str(output_dir)
    return output_dir, resume_from, folder


def _local_inputs(config: TrainConfig) -> tuple[Path | None, list[Path]]:
    """The model folder and the data files or folders of this run that are on this machine (for
    lstune.train.outputs.check_overlaps); hub ids, presets and builtin data are not."""
    from lstune.data.sources import mixture_entries
    from lstune.models.loading import resolve_source

    source = resolve_source(config.model.name)
    model_dir = Path(source.location) if source.kind == "local" else None
    sources = [name for name, _ in mixture_entries(config.data.source)] if config.data.source else []
    sources += [config.data.eval_data] if config.data.eval_data else []
    paths = [Path(name).expanduser() for name in sources if isinstance(name, str)]
    return model_dir, [path for path in paths if path.exists()]


def _extra_outputs(config: TrainConfig) -> tuple[str, ...]:
    """What the run writes in its folder besides the fixed names and its checkpoints: the plot, the trackers'."""
    from lstune.train.plots import PLOT_FILE
    from lstune.train.tracking import folders

    return (PLOT_FILE, *folders(config.run.trackers()))


def _setup_tokenizer(config: TrainConfig, spec):
    """Tokenizer first: the data is built (and its problems reported) before any weights load."""
    from lstune.data.tokenizer import load_model_tokenizer

    source = spec.source
    return load_model_tokenizer(
        source.kind, source.location, name=source.name, vocab_size=spec.config.vocab_size,
        trust_remote_code=config.model.trust_remote_code,
    )


def _setup_data(config: TrainConfig, tokenizer, model_config, *, source: str | None = None, flag: str = "--data"):
    """The training data, or (`source`, `flag`) other data built the same way (--max-records is --data's only)."""
    import datasets

    from lstune.data.dataset import build_dataset
    from lstune.errors import DataError

    datasets.disable_progress_bars()
    data = config.data
    if data.source is None:
        from lstune.errors import ConfigError

        raise ConfigError(["no training data: set config.data.source (--data)."])
    max_records = data.max_records if source is None else None
    read = data.reading() if source is None else {}  # --data-split/-subset/-fields: --data's, like --max-records
    if source is None and data.data_streaming:
        return _setup_stream(config, tokenizer, model_config, read)
    source = source or data.source
    dataset = build_dataset(
        source, tokenizer, data.seq_len, pack=data.pack, seed=config.optim.seed, max_records=max_records, **read
    )
    max_id, vocab = dataset.summary()["max_token_id"], model_config.vocab_size
    if max_id is not None and max_id >= vocab:
        raise DataError(
            f"{flag} {source!r} has token id {max_id} (as an input id or a label), but --model {config.model.name!r} has a vocabulary of "
            f"{vocab}; pre-tokenized data must come from the model's own tokenizer."
        )
    return dataset


def _setup_stream(config: TrainConfig, tokenizer, model_config, read: dict):
    """--data-streaming: the training data as a stream (lstune.data.streaming); its token ids are checked against
    the vocabulary as they are read."""
    from lstune.data.streaming import open_stream

    data = config.data
    return open_stream(data.source, tokenizer, data.seq_len, pack=data.pack, seed=config.optim.seed,
                       shuffle_buffer=data.shuffle_buffer(), vocab_size=model_config.vocab_size,
                       max_records=data.max_records, **read)


def _setup_eval_data(config: TrainConfig, tokenizer, model_config, dataset):
    """(training samples, validation samples or None): --eval-data is built like --data; --eval-split holds
    samples of the training data out (lstune.data.split)."""
    data = config.data
    if data.eval_data is not None:
        return dataset, _setup_data(config, tokenizer, model_config, source=data.eval_data, flag="--eval-data")
    if data.eval_split is not None:
        from lstune.data.split import split_samples

        return split_samples(dataset, data.eval_split, pack=data.pack, seed=config.optim.seed)
    return dataset, None


TRUNCATION_WARN_FRACTION = 0.1


def truncation_warning(summary: dict[str, Any]) -> str | None:
    """A warning when cutting records to --seq-len drops a tenth or more of the data's tokens."""
    dropped, kept = summary.get("truncated_tokens", 0), summary.get("tokens", 0)
    if not dropped or dropped < TRUNCATION_WARN_FRACTION * (dropped + kept):
        return None
    return (
        f"warning: {summary['truncated_records']} records are longer than --seq-len {summary['seq_len']}; cutting "
        f"them drops {dropped:,} of {dropped + kept:,} tokens ({100 * dropped / (dropped + kept):.0f}%), which are "
        "never trained on. Raise --seq-len, or use --pack to train on every token."
    )


def _make_evaluator(config: TrainConfig, eval_dataset, prepared, runtime: Runtime, reporter):
    if eval_dataset is None:
        return None
    from lstune.train.evaluate import Evaluator

    passkey, passkey_note = _passkey_accuracy(config)
    evaluator = Evaluator(eval_dataset, prepared.eval_sums, runtime, max_samples=config.data.eval_max_samples,
                          passkey=passkey, chunks=prepared.memory.attn_chunking)
    when = f"every {config.run.eval_every} steps and at the end" if config.run.eval_every else "at the end"
    reporter.note(f"validation: {evaluator.samples} of {len(eval_dataset)} samples, {when}{passkey_note}")
    return evaluator


def _passkey_accuracy(config: TrainConfig) -> tuple[bool, str]:
    """Whether validation judges passkeys (its samples' labels are exactly their answers: one answer per sample,
    so not with --pack), and what the validation note adds about it."""
    from lstune.data.synthetic import ANSWER_SOURCES

    data = config.data
    source = data.eval_data if data.eval_data is not None else data.source
    if source == "builtin:passkey":
        return False, " (no passkey accuracy on text records, trained on every token: --eval-data builtin:passkey-eval)"
    if source not in ANSWER_SOURCES:
        return False, ""
    if data.pack:
        return False, " (no passkey accuracy with --pack: it judges one answer per sample)"
    return True, ", with passkey accuracy"


def total_steps(config: TrainConfig, num_samples: int | None, world_size: int = 1) -> int:
    optim = config.optim
    if optim.max_steps is not None:
        return optim.max_steps
    if num_samples is None:  # a stream (--data-streaming): the CLI refuses this before anything loads
        from lstune.errors import ConfigError

        raise ConfigError(config.training_problems())
    per_step = optim.micro_batch_size * optim.grad_accum * world_size
    return max(1, math.ceil((optim.epochs or 1.0) * num_samples / per_step))


def _resume(engine, checkpoint: Path) -> tuple[RunState, dict]:
    from lstune.errors import CheckpointError
    from lstune.train.checkpoint import TRAINER_STATE_NAME, load_checkpoint

    train_state = load_checkpoint(checkpoint, read_state=engine.load)
    if "consumed_samples" not in train_state:  # the types of what is there were checked when it was read
        raise CheckpointError(f"{checkpoint / TRAINER_STATE_NAME}: consumed_samples is missing, so the run cannot "
                              "tell where it stopped in the data (corrupt or edited); resume from another "
                              "checkpoint or start afresh.")
    state = RunState(train_state["step"], train_state["consumed_samples"], train_state.get("tokens_seen", 0))
    return state, train_state.get("config", {})


# Settings whose change makes a resumed run differ from continuing the old one (the data stream, the
# samples per step, the objective); a change is allowed but said.
# Settings about this invocation, not the run's numbers: a change of these on resume is not worth a note.
_NOT_NOTED_ON_RESUME = frozenset({"output_dir", "stop_at_step", "log_every", "skip_self_check", "force"})


def config_changes(saved: dict, current: dict) -> list[str]:
    """Every setting of the checkpoint's run that this run changes (docs/guarantees.md: each change is said)."""
    return [
        f"{key} {saved[key]!r} → {current.get(key)!r}"
        for key in saved
        if key not in _NOT_NOTED_ON_RESUME and key in current and saved[key] != current[key]
    ]


def _recipe_view(config: TrainConfig) -> dict[str, Any]:
    view = config.to_dict()
    for key in ("resume", "overwrite", "trust_checkpoint"):  # about this invocation, not the run's recipe
        view.pop(key)
    # A local model folder is recorded by its absolute path: a resume or a rerun of config.yaml from another
    # working directory finds the same model (a relative path would name another, or none).
    model = Path(str(view["model"])).expanduser()
    if not _is_hub_or_preset(str(view["model"])) and model.is_dir():
        view["model"] = str(model.resolve())
    return view


def _is_hub_or_preset(name: str) -> bool:
    from lstune.models.loading import resolve_source

    try:
        return resolve_source(name).kind != "local"
    except UserError:
        return True


def _plan(config, loaded, prepared, dataset, max_steps, output_dir, runtime: Runtime, state, choice=None) -> dict[str, Any]:
    model = prepared.model
    plan = {
        "model": f"{config.model.name} ({loaded.source.kind})",
        "parameters": sum(_numel(p) for p in model.parameters()) + _metp_numel(prepared, trainable=False),
        "trainable_parameters": sum(_numel(p) for p in model.parameters() if p.requires_grad)
        + _metp_numel(prepared, trainable=True),
        "device": str(runtime.device),
        "seq_len": config.data.seq_len,
        "data": dataset.summary()["note"],
        "steps": max_steps,
        "start_step": state.step,
        "samples_per_step": config.optim.micro_batch_size * config.optim.grad_accum * runtime.world_size,
        "output_dir": str(output_dir),
        "memory": _describe_memory(prepared.memory) + (f" (auto: {choice.reason})" if choice is not None else ""),
    }
    if runtime.distributed:
        plan["parallelism"] = f"{runtime.world_size} processes: SP {runtime.sp} × DP {runtime.dims.dp}" + (
            f" (SP = Ulysses {runtime.dims.ulysses} × ring {runtime.dims.ring})" if runtime.dims.ring > 1 else "") + (
            f"; METP MLP: 1/{runtime.sp} of its weights per rank, rotated" if prepared.metp is not None else "")
    return plan


def _metp_numel(prepared, *, trainable: bool) -> int:
    """The full MLP weights METP keeps as shards outside `model.parameters()` (lstune.memory.metp_mlp)."""
    metp = getattr(prepared, "metp", None)
    if metp is None:
        return 0
    shards = [p for p in metp.shard_parameters() if p.requires_grad or not trainable]
    return sum(p.numel() for p in shards) * metp.ring.size


def _numel(param) -> int:
    """A parameter's size as the model defines it: ZeRO-3 leaves each rank an empty placeholder (the full count in
    `ds_numel`), and a 4-bit weight stores two values per byte (its `quant_state` keeps the shape)."""
    if hasattr(param, "ds_numel"):
        return int(param.ds_numel)
    shape = getattr(getattr(param, "quant_state", None), "shape", None)
    return int(math.prod(shape)) if shape is not None else param.numel()


def _describe_memory(memory_plan) -> str:
    """The memory techniques as applied (lstune.memory.apply.MemoryPlan), chunked attention included."""
    m = memory_plan
    tiles = lambda n: f"{n} tile" + ("s" if n != 1 else "")  # noqa: E731
    offload = "offloaded checkpoints" if m.offload else (f"no offload ({m.offload_note})" if m.offload_note else None)
    parts = [
        f"tiled MLP {tiles(m.mlp_tiles)}" if m.tiled_mlp != "off" else "tiled MLP off",
        "mini-sequence" if m.mini_sequence else None,
        f"attention in {m.attn_chunks_at_seq_len} chunks" if m.attn_chunks != "off" else None,
        f"loss {m.loss_backend} ({tiles(m.loss_tiles_at_seq_len)})",
        "checkpointing" if m.checkpointing else "no checkpointing",
        "attention's output kept, not recomputed" if m.save_attention else None,
        offload,
        _describe_placement(m.summary()["checkpoint_placement"]),
    ]
    return ", ".join(p for p in parts if p)


def _describe_placement(placed: dict | None) -> str | None:
    """The checkpoint placement: which layers where, host and device bytes, the extra recompute."""
    if placed is None:
        return None
    mib = lambda n: f"{n / 2**20:,.1f} MiB"  # noqa: E731
    return (f"checkpoint placement: {placed['layers']} (host {mib(placed['host_bytes'])}, device "
            f"{mib(placed['device_bytes'])}, recompute +{placed.get('extra_recompute_pct', 0.0)}% of step FLOPs)")


@dataclass
class _Loop:
    """What the step loop works with: the run, its built model and engine, and where each step's record goes."""

    config: TrainConfig
    built: Any  # lstune.train.build.Built
    runtime: Runtime
    state: RunState
    result: TrainResult
    reporter: Any
    folder: Any
    evaluator: Any = None
    metrics: Any = None  # MetricsWriter (main process)
    trackers: Any = None  # --report-to (main process)
    phases: Any = None  # live phases for the CLI's reporter

    @property
    def engine(self):
        return self.built.engine

    def close(self) -> None:
        if self.phases is not None:
            self.phases.remove()
        for sink in (self.trackers, self.metrics):
            if sink is not None:
                sink.close()


def _loop(config, built, dataset, runtime: Runtime, state, result, reporter, folder, evaluator=None) -> None:
    """Steps until max_steps, a signal or --stop-at-step; then the last checkpoint and, when finished, the export."""
    from lstune.train.guard import NonFiniteGuard

    raise_if_terminated()  # the last chance before the first step (lstune.train.signals.on_sigterm)
    batches = built.batches(dataset, runtime, start_sample=state.consumed_samples)
    run = _open_loop(config, built, runtime, state, result, reporter, folder, evaluator)
    stepper = Stepper(config, built.engine, runtime, built.prepared.loss_sum, run.phases)
    guard = NonFiniteGuard(skip=config.run.skip_nonfinite_steps)
    try:
        with StopOnSignal() as stop:
            while state.step < result.max_steps:
                # Checked before each step as well as after it: a signal that arrives during a save stops
                # the run right after that save, without one more step.
                if _stop_requested(runtime, stop, result, reporter):
                    break
                _record(run, stepper.step(batches, state), guard)
                if _stop_requested(runtime, stop, result, reporter) or _stop_at_step(run):
                    break
                _save_if_due(run)
            _finish(run)
    finally:
        run.close()


def _open_loop(config, built, runtime: Runtime, state, result, reporter, folder, evaluator) -> _Loop:
    """The loop's sinks: metrics.jsonl and the trackers on the main process, the reporter's live phases."""
    from lstune.train.metrics import METRICS_FILE, MetricsWriter

    if folder is not None:
        folder.claim(METRICS_FILE)
    run = _Loop(config, built, runtime, state, result, reporter, folder, evaluator)
    if runtime.is_main:
        run.metrics = MetricsWriter(result.output_dir, resume_step=state.step)
        run.trackers = _start_trackers(config, result.output_dir, folder)
    run.phases = _phase_tracker(reporter, built.prepared, runtime)
    return run


def _record(run: _Loop, record: dict, guard) -> None:
    """One step's record: validation when due, then metrics, trackers, history, the reporter, the NaN guard."""
    from lstune.train.evaluate import eval_due

    config, state, result = run.config, run.state, run.result
    if run.evaluator is not None and eval_due(state.step, result.max_steps, config.run.eval_every):
        _enter(run.phases, "eval")
        record.update(run.evaluator.run(run.engine.model))
    if run.metrics is not None:
        run.metrics.write(record)
    if run.trackers is not None:
        run.trackers.log(record)
    result.history.append(record)
    run.reporter.step(record)
    note = guard.check(record, result.last_checkpoint)
    if note:
        run.reporter.note(note)


def _stop_at_step(run: _Loop) -> bool:
    stop_at = run.config.run.stop_at_step
    if stop_at is None or run.state.step < stop_at:
        return False
    run.result.stopped_early = True
    run.reporter.note(f"stopping at step {run.state.step} (--stop-at-step); continue with --resume")
    return True


def _save_if_due(run: _Loop) -> None:
    every, step = run.config.run.save_every, run.state.step
    if every and step % every == 0 and step < run.result.max_steps:
        _enter(run.phases, "checkpoint save")
        run.result.last_checkpoint = _save(run.config, run.engine, run.state, run.result, run.reporter, run.folder,
                                           run.runtime)


def _finish(run: _Loop) -> None:
    """After the last step: a checkpoint of it (unless just saved), and the export unless stopped."""
    state, result = run.state, run.result
    result.steps_done = state.step
    if state.step > 0 and result.last_checkpoint != result.output_dir / f"checkpoint-{state.step}":
        _enter(run.phases, "checkpoint save")
        result.last_checkpoint = _save(run.config, run.engine, state, result, run.reporter, run.folder, run.runtime)
    if not (result.interrupted or result.stopped_early):
        _enter(run.phases, "export")
        _export(run.config, run.engine, run.built.loaded, run.runtime, result, run.reporter, run.folder)


def _start_trackers(config: TrainConfig, output_dir: Path, folder):
    """--report-to: the trackers, with the run's config; None when none is asked for."""
    names = config.run.trackers()
    if not names:
        return None
    from lstune.train.tracking import Trackers, folders

    for name in folders(names):
        folder.claim(name)
    return Trackers(names, output_dir, _recipe_view(config))


def _phase_tracker(reporter, prepared, runtime: Runtime):
    """Live phases for a reporter that shows them (the CLI's), on the main process only."""
    if not runtime.is_main or not hasattr(reporter, "phase"):
        return None
    from lstune.train.phases import PhaseTracker

    return PhaseTracker(reporter.phase, prepared.parts.layers)


def _enter(phases, name: str) -> None:
    if phases is not None:
        phases.set(name)


def _plot(result: TrainResult, folder, reporter) -> None:
    """OUTPUT_DIR/metrics.png; a run that trained is not failed by its picture (the metrics stay in metrics.jsonl)."""
    from lstune.train.plots import PLOT_FILE, plot_run

    folder.claim(PLOT_FILE)
    try:
        reporter.note(f"plot saved: {plot_run(result.output_dir)}")
    except (OSError, ValueError, RuntimeError) as exc:
        reporter.note(f"warning: the plot was not written ({exc}); `lstune plot {result.output_dir}` retries.")


def _mixture_note(config: TrainConfig, dataset, consumed: int) -> str | None:
    """With several --data sources: the share of each among the samples this run has trained on so far."""
    from lstune.data.loader import StreamSampler
    from lstune.data.mixture import MixtureDataset, realised_shares

    if not isinstance(dataset, MixtureDataset) or consumed == 0:
        return None
    shares = realised_shares(dataset, StreamSampler(len(dataset), seed=config.optim.seed), consumed)
    return f"data mixture realised over {consumed} samples: " + ", ".join(
        f"{name} {100 * share:.1f}%" for name, share in shares.items())


def _stop_requested(runtime: Runtime, stop, result: TrainResult, reporter) -> bool:
    if not runtime.any(stop.requested):
        return False
    result.interrupted = True
    reporter.note(f"{stop.signal_name or 'stop signal'} received: saving a checkpoint, then stopping")
    return True


def _save(config, engine, state: RunState, result: TrainResult, reporter, folder, runtime) -> Path:
    """Every rank takes part (DeepSpeed writes its shards); the checkpoint store coordinates them."""
    from lstune.train.checkpoint import save_checkpoint
    from lstune.train.guard import DivergedError
    from lstune.train.outputs import write_errors
    from lstune.train.preflight import stream_order

    if hasattr(engine, "weights_finite") and not engine.weights_finite():
        raise DivergedError(
            f"step {state.step}: the weights are no longer finite (NaN or inf) though the loss and gradient norm "
            f"were; nothing was saved, and the newest checkpoint is {result.last_checkpoint or 'none'}. Lower --lr."
        )

    train_state = {
        "step": state.step,
        "consumed_samples": state.consumed_samples,
        "tokens_seen": state.tokens_seen,
        "config": _recipe_view(config),
        "layout": runtime.layout(config.parallel.metp_mlp, config.memory.attn_chunks),
        "lstune_version": __version__,
    }
    order = stream_order(config)
    if order is not None:  # checked against the resuming run's (lstune.train.preflight)
        train_state["stream_order"] = order
    name = f"checkpoint-{state.step}"
    if folder is not None:
        folder.claim(name)
    with write_errors(result.output_dir / name, kept=result.last_checkpoint):
        path = save_checkpoint(
            result.output_dir, state.step, write_state=engine.save, train_state=train_state,
            keep_last=config.run.keep_last or None,
        )
    note_checkpoint(path)
    reporter.note(f"checkpoint saved: {path}")
    return path


def _export(config, engine, loaded, runtime: Runtime, result: TrainResult, reporter, folder) -> None:
    """OUTPUT_DIR/final (and final-merged with --merge-lora), each written to a temp folder and renamed.
    Every rank takes part in gathering sharded weights; only the main process writes."""
    result.final_dir = _export_one(result, FINAL_DIR, engine, loaded, runtime, folder, merge_lora=False)
    if config.model.merge_lora:
        result.merged_dir = _export_one(result, MERGED_DIR, engine, loaded, runtime, folder, merge_lora=True)
    reporter.note(f"final model saved: {result.final_dir}")
    _note_missing_base(config, loaded.source.kind, result.final_dir, runtime)


def _note_missing_base(config, source_kind: str, final_dir: Path, runtime: Runtime) -> None:
    """final/NO_BASE_MODEL.txt beside an adapter that has no base to load (lstune.train.preflight)."""
    from lstune.train.preflight import NO_BASE_NOTE, adapter_without_base

    warning = adapter_without_base(config, source_kind)
    if warning and runtime.is_main:
        (final_dir / NO_BASE_NOTE).write_text(warning.removeprefix("warning: ") + "\n", encoding="utf-8")


def _point_adapter_at_base(folder: Path, source) -> None:
    """A LoRA adapter names its base so that AutoModelForCausalLM.from_pretrained(folder) finds it: the hub id,
    or the local folder's absolute path (peft records the name it was given, relative or none). A preset has
    no weights anywhere (random init): its adapter keeps no base; --merge-lora writes a loadable model."""
    import json

    config_path = folder / "adapter_config.json"
    if not config_path.is_file() or source.kind == "preset":
        return
    config = json.loads(config_path.read_text())
    config["base_model_name_or_path"] = str(Path(source.location).resolve()) if source.kind == "local" else source.location
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _export_one(result: TrainResult, name: str, engine, loaded, runtime: Runtime, folder, *, merge_lora: bool) -> Path:
    from lstune.train.atomic import atomic_dir
    from lstune.train.outputs import write_errors

    target = result.output_dir / name
    if runtime.is_main:
        folder.claim(name)
        with write_errors(target, kept=result.last_checkpoint), atomic_dir(target) as tmp:
            engine.export(tmp, merge_lora=merge_lora)
            _point_adapter_at_base(tmp, loaded.source)
            if hasattr(loaded.tokenizer, "save_pretrained"):
                loaded.tokenizer.save_pretrained(str(tmp))
    else:
        engine.export(target, merge_lora=merge_lora)  # takes part in the gathers; writes nothing
    runtime.barrier()
    return target
