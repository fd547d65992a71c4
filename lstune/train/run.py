"""`train(config)`: the single-device training run, from output folder to final model.

Setup is split into small steps (output folder → device → model → data → engine → resume), then the
loop: for each optimizer step, `grad_accum` micro-batches whose summed token losses are divided by the
token count of the whole window — so 4 micro-steps of 1 sample equal 1 step of 4 samples exactly.
"""

from __future__ import annotations

import math
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lstune import __version__
from lstune.config.schema import TrainConfig
from lstune.errors import UserError
from lstune.train.reporter import LogReporter, Reporter
from lstune.train.signals import StopOnSignal

FINAL_DIR = "final"
MERGED_DIR = "final-merged"
CONFIG_FILE = "config.yaml"
OWN_ENTRIES = (".tmp-", ".old-checkpoint-", FINAL_DIR, MERGED_DIR, "metrics.jsonl", CONFIG_FILE)


@dataclass
class TrainResult:
    output_dir: Path
    steps_done: int
    max_steps: int
    interrupted: bool = False
    stopped_early: bool = False
    final_dir: Path | None = None
    merged_dir: Path | None = None
    last_checkpoint: Path | None = None
    history: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class RunState:
    step: int = 0
    consumed_samples: int = 0
    tokens_seen: int = 0


def train(config: TrainConfig, reporter: Reporter | None = None) -> TrainResult:
    """Run the training `config` describes; returns when finished or stopped by SIGINT/SIGTERM."""
    from transformers.utils import logging as hf_logging

    reporter = reporter or LogReporter()
    hf_logging.disable_progress_bar()  # lstune draws its own progress; HF's per-save bars are noise here
    output_dir, resume_from = prepare_output_dir(config)
    device, autocast_dtype = _setup_device(config)
    model_config = _check_model_support(config, device)
    tokenizer, notes = _setup_tokenizer(config)
    dataset = _setup_data(config, tokenizer, model_config)
    loaded = _setup_model(config, device, tokenizer, notes)
    for note in loaded.notes:
        reporter.note(note)
    max_steps = total_steps(config, len(dataset))
    engine = _make_engine(config, loaded.model, max_steps)

    state = RunState()
    if resume_from is not None:
        state = _resume(engine, resume_from)
        reporter.note(f"resumed from {resume_from} at step {state.step}")
    _write_config_snapshot(output_dir, config)

    reporter.start(_plan(config, loaded, dataset, max_steps, output_dir, device, state))
    result = TrainResult(output_dir, state.step, max_steps)
    _loop(config, engine, loaded, dataset, device, autocast_dtype, state, result, reporter)
    reporter.end(result)
    return result


def prepare_output_dir(config: TrainConfig) -> tuple[Path, Path | None]:
    """Create or check the output folder; resolve the checkpoint to resume from. Never deletes
    anything unless --overwrite, and then only lstune's own files."""
    from lstune.train.checkpoint import resolve_resume

    output_dir = Path(config.output_dir) if config.output_dir else _default_output_dir(config)
    resume_from = None
    if config.resume:
        resume_from = resolve_resume(output_dir, config.resume)
    elif output_dir.exists() and any(output_dir.iterdir()):
        if not config.overwrite:
            raise UserError(
                f"--output-dir {str(output_dir)!r} already exists and is not empty; nothing is overwritten "
                "unasked. Use --resume to continue that run, --overwrite to replace it, or another --output-dir."
            )
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
    config.output_dir = str(output_dir)
    return output_dir, resume_from


def _default_output_dir(config: TrainConfig) -> Path:
    name = Path(config.model).name.lower().replace(":", "-")
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


def _setup_device(config: TrainConfig):
    """CUDA when present (bf16 autocast over fp32 master weights unless --dtype fp32), else CPU fp32."""
    import torch

    if torch.cuda.is_available():
        from lstune.memory.allocator import ensure_expandable_segments

        ensure_expandable_segments()
        device = torch.device("cuda", torch.cuda.current_device())
        return device, (None if config.dtype == "fp32" else torch.bfloat16)
    return torch.device("cpu"), (torch.bfloat16 if config.dtype == "bf16" else None)


def _check_model_support(config: TrainConfig, device):
    """Refuse, from the model's config alone, what lstune's attention would get wrong here; returns that
    config."""
    from lstune.models.attention import check_attention_support
    from lstune.models.loading import load_config, resolve_source

    model_config = load_config(resolve_source(config.model), trust_remote_code=config.trust_remote_code)
    check_attention_support(
        model_config, pack=config.pack, seq_len=config.seq_len, backend=config.attn, device=device.type
    )
    return model_config


def _setup_tokenizer(config: TrainConfig):
    """Tokenizer first: the data is built (and its problems reported) before any weights load."""
    from lstune.models.loading import load_tokenizer_for

    return load_tokenizer_for(config.model, trust_remote_code=config.trust_remote_code)


def _setup_model(config: TrainConfig, device, tokenizer, notes):
    """Load, then apply the techniques in their fixed order (lstune.train.prepare)."""
    from lstune.models.loading import load_model
    from lstune.train.prepare import prepare_model

    loaded = load_model(
        config.model,
        init=config.init,
        trust_remote_code=config.trust_remote_code,
        seed=config.seed,
        tokenizer=tokenizer,
        notes=notes,
    )
    loaded.model, loaded.memory_plan = prepare_model(loaded.model, config, device)
    return loaded


def _setup_data(config: TrainConfig, tokenizer, model_config):
    import datasets

    from lstune.data.dataset import build_dataset
    from lstune.errors import DataError

    datasets.disable_progress_bars()
    dataset = build_dataset(
        config.data, tokenizer, config.seq_len, pack=config.pack, seed=config.seed, max_records=config.max_records
    )
    max_id, vocab = dataset.summary()["max_token_id"], model_config.vocab_size
    if max_id is not None and max_id >= vocab:
        raise DataError(
            f"--data {config.data!r} has token id {max_id}, but --model {config.model!r} has a vocabulary of "
            f"{vocab}; pre-tokenized data must come from the model's own tokenizer."
        )
    return dataset


def total_steps(config: TrainConfig, num_samples: int) -> int:
    if config.max_steps is not None:
        return config.max_steps
    per_step = config.micro_batch_size * config.grad_accum
    return max(1, math.ceil((config.epochs or 1.0) * num_samples / per_step))


def _make_engine(config: TrainConfig, model, max_steps: int):
    from lstune.train.engine import OptimConfig, TorchEngine

    warmup = config.warmup_steps if config.warmup_steps is not None else math.ceil(0.03 * max_steps)
    optim = OptimConfig(
        lr=config.lr,
        weight_decay=config.weight_decay,
        betas=(config.adam_beta1, config.adam_beta2),
        eps=config.adam_eps,
        warmup_steps=min(warmup, max_steps),
        max_steps=max_steps,
        schedule=config.schedule,
        min_lr_ratio=config.min_lr_ratio,
        max_grad_norm=config.max_grad_norm,
    )
    return TorchEngine(model, optim)


def _resume(engine, checkpoint: Path) -> RunState:
    from lstune.train.checkpoint import load_checkpoint

    train_state = load_checkpoint(checkpoint, read_state=engine.load)
    return RunState(train_state["step"], train_state["consumed_samples"], train_state.get("tokens_seen", 0))


def _write_config_snapshot(output_dir: Path, config: TrainConfig) -> None:
    import yaml

    text = f"# resolved config written by lstune {__version__}; rerun with: lstune train --config {CONFIG_FILE}\n"
    (output_dir / CONFIG_FILE).write_text(text + yaml.safe_dump(_recipe_view(config), sort_keys=False))


def _recipe_view(config: TrainConfig) -> dict[str, Any]:
    view = config.to_dict()
    view.pop("resume")
    view.pop("overwrite")
    return view


def _plan(config, loaded, dataset, max_steps, output_dir, device, state) -> dict[str, Any]:
    model = loaded.model
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    plan = {
        "model": f"{config.model} ({loaded.source.kind})",
        "parameters": total,
        "trainable_parameters": trainable,
        "device": str(device),
        "seq_len": config.seq_len,
        "data": dataset.summary()["note"],
        "steps": max_steps,
        "start_step": state.step,
        "samples_per_step": config.micro_batch_size * config.grad_accum,
        "output_dir": str(output_dir),
    }
    plan["memory"] = _describe_memory(loaded.memory_plan)
    return plan


def _describe_memory(memory_plan) -> str:
    s = memory_plan.summary()
    mlp, loss, offload = s["tiled_mlp"], s["tiled_loss"], s["offload_checkpoints"]
    parts = [
        f"tiled MLP {mlp['tiles']} tiles" if mlp["setting"] != "off" else "tiled MLP off",
        "mini-sequence" if mlp["mini_sequence"] else None,
        f"loss {loss['backend']} ({loss['tiles']} tiles)",
        "checkpointing" if s["checkpointing"] else "no checkpointing",
        ("offloaded checkpoints" if offload["enabled"] else f"no offload ({offload['note']})" if offload["note"] else None),
    ]
    return ", ".join(p for p in parts if p)


def _loop(config, engine, loaded, dataset, device, autocast_dtype, state, result, reporter) -> None:
    from lstune.data.loader import make_dataloader
    from lstune.train.metrics import MetricsWriter

    loader = make_dataloader(
        dataset, config.micro_batch_size, seed=config.seed, start_sample=state.consumed_samples
    )
    batches = iter(loader)
    metrics = MetricsWriter(result.output_dir, resume_step=state.step)
    stepper = _Stepper(config, engine, device, autocast_dtype)
    try:
        with StopOnSignal() as stop:
            while state.step < result.max_steps:
                record = stepper.step(batches, state)
                metrics.write(record)
                result.history.append(record)
                reporter.step(record)
                if stop.requested:
                    result.interrupted = True
                    reporter.note(f"{stop.signal_name} received: saving a checkpoint, then stopping")
                    break
                if config.stop_at_step is not None and state.step >= config.stop_at_step:
                    result.stopped_early = True
                    reporter.note(f"stopping at step {state.step} (--stop-at-step); continue with --resume")
                    break
                if config.save_every and state.step % config.save_every == 0 and state.step < result.max_steps:
                    result.last_checkpoint = _save(config, engine, state, result.output_dir, reporter)
            result.steps_done = state.step
            if state.step > 0 and (result.last_checkpoint is None or not _is_step(result.last_checkpoint, state.step)):
                result.last_checkpoint = _save(config, engine, state, result.output_dir, reporter)
            if not (result.interrupted or result.stopped_early):
                _export(config, engine, loaded, result, reporter)
    finally:
        metrics.close()


def _is_step(checkpoint: Path, step: int) -> bool:
    return checkpoint.name == f"checkpoint-{step}"


class _Stepper:
    """One optimizer step over `grad_accum` micro-batches, and the metrics record it produces."""

    def __init__(self, config: TrainConfig, engine, device, autocast_dtype):
        from lstune.memory.loss import causal_lm_loss_sum

        self.config = config
        self.engine = engine
        self.device = device
        self.autocast_dtype = autocast_dtype
        self.loss_sum = causal_lm_loss_sum

    def step(self, batches, state: RunState) -> dict[str, Any]:
        import torch

        from lstune.train.metrics import host_rss_bytes, peak_device_mem_bytes, reset_peak

        reset_peak(self.device)
        start = time.perf_counter()
        window = [next(batches) for _ in range(self.config.grad_accum)]
        window_tokens = int(sum(int((b["shift_labels"] != -100).sum()) for b in window))
        denominator = max(window_tokens, 1)
        total = torch.zeros((), dtype=torch.float64)
        for batch in window:
            batch = {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}
            with torch.autocast(self.device.type, dtype=self.autocast_dtype or torch.float32,
                                enabled=self.autocast_dtype is not None):
                loss_sum, _ = self.loss_sum(self.engine.model, batch)
            self.engine.backward(loss_sum / denominator)
            total += loss_sum.detach().double().cpu()
        stats = self.engine.step()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        elapsed = time.perf_counter() - start

        input_tokens = sum(int(b["input_ids"].numel()) for b in window)
        state.step += 1
        state.consumed_samples += sum(int(b["input_ids"].shape[0]) for b in window)
        state.tokens_seen += input_tokens
        return {
            "step": state.step,
            "loss": float(total) / denominator if window_tokens else float("nan"),
            "tokens": input_tokens,
            "label_tokens": window_tokens,
            "tokens_per_s": input_tokens / elapsed,
            "step_time_s": elapsed,
            "lr": stats["lr"],
            "grad_norm": stats["grad_norm"],
            "peak_device_mem_bytes": peak_device_mem_bytes(self.device),
            "host_rss_bytes": host_rss_bytes(),
            "tokens_seen": state.tokens_seen,
        }


def _save(config, engine, state: RunState, output_dir: Path, reporter) -> Path:
    from lstune.train.checkpoint import save_checkpoint

    train_state = {
        "step": state.step,
        "consumed_samples": state.consumed_samples,
        "tokens_seen": state.tokens_seen,
        "config": _recipe_view(config),
        "lstune_version": __version__,
    }
    path = save_checkpoint(
        output_dir, state.step, write_state=engine.save, train_state=train_state, keep_last=config.keep_last or None
    )
    reporter.note(f"checkpoint saved: {path}")
    return path


def _export(config, engine, loaded, result: TrainResult, reporter) -> None:
    """OUTPUT_DIR/final (and final-merged with --merge-lora), each written to a temp folder and renamed."""
    from lstune.train.atomic import atomic_dir

    with atomic_dir(result.output_dir / FINAL_DIR) as tmp:
        engine.export(tmp)
        _save_tokenizer(loaded.tokenizer, tmp)
    result.final_dir = result.output_dir / FINAL_DIR
    if config.merge_lora:
        with atomic_dir(result.output_dir / MERGED_DIR) as tmp:
            engine.export(tmp, merge_lora=True)
            _save_tokenizer(loaded.tokenizer, tmp)
        result.merged_dir = result.output_dir / MERGED_DIR
    reporter.note(f"final model saved: {result.final_dir}")


def _save_tokenizer(tokenizer, out_dir: Path) -> None:
    if hasattr(tokenizer, "save_pretrained"):
        tokenizer.save_pretrained(str(out_dir))
