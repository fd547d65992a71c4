"""One bench trial, run in a process of its own (lstune.bench.runner starts it): build the model of one
configuration, run `warmup + steps` training steps on one length, and write a record of what happened.

A trial is a `Job`; its record (a JSON object) says the outcome ("ok", "oom" for a device or allocator
out-of-memory error, "error" for anything else) and, when it ran, the step times, losses, peaks and the
estimate of the same configuration on the same hardware (lstune.estimate, as `lstune train` makes it).

The step is `lstune train`'s: the same runtime, model loading, technique order (lstune.train.prepare),
engine choice and `Stepper`; the data are random tokens of the model's vocabulary (or --data). The `hf`
rung is plain Hugging Face instead: the model built with HF's own SDPA attention and
`gradient_checkpointing_enable`, and its loss from `model(input_ids=..., labels=...)`; lstune patches
nothing in it. Both are driven by the same Stepper, so only the model differs.

Run under a launcher for several processes: `python -m lstune.bench.trial JOB.json RESULT.json`.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from lstune.data.batch import IGNORE_INDEX
from lstune.models.quant import quiet_cpu_kernel_warning

quiet_cpu_kernel_warning()  # a trial's processes (the forkserver included) have no CLI to configure logging


@dataclass
class Job:
    """What one trial runs. `kind`: "step" (training steps), "estimates" (the estimate of `config` at each of
    `lengths`, for the plots' lines), or "rates" (kernel rates, lstune.bench.rates)."""

    id: int
    kind: str
    rung: str
    config: dict[str, Any]  # flat values of a TrainConfig (seq_len included)
    purpose: str = "measure"  # "measure" or "search"
    plain_hf: bool = False
    warmup: int = 1
    steps: int = 3
    lengths: list[int] = field(default_factory=list)
    host_cap: int | None = None  # bytes of host memory the trial may use (--max-host-mem): what its plan sees

    @property
    def seq_len(self) -> int:
        return self.config["seq_len"]

    @property
    def processes(self) -> int:
        return self.config["gpus"]

    def describe(self) -> str:
        from lstune.config.parse import format_length

        if self.kind != "step":
            return f"{self.kind} ({self.rung})" if self.kind == "estimates" else self.kind
        procs = f" on {self.processes} processes" if self.processes > 1 else ""
        return f"{self.rung} at {format_length(self.seq_len)} ({self.purpose}){procs}"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class RandomTokens(Dataset):
    """`size` samples of `seq_len` uniformly random token ids below `vocab`, each from its own seed, in the batch
    contract of lstune.data (input_ids, position_ids, pre-shifted labels; the last token has no target)."""

    def __init__(self, vocab: int, seq_len: int, *, seed: int, size: int = 64):
        self.vocab, self.seq_len, self.seed, self.size = vocab, seq_len, seed, size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        ids = torch.randint(0, self.vocab, (self.seq_len,), generator=gen)
        labels = torch.roll(ids, -1)
        labels[-1] = IGNORE_INDEX
        return {"input_ids": ids, "position_ids": torch.arange(self.seq_len), "shift_labels": labels}


def hf_loss_sum(batch: dict, model) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed token loss, label count) from Hugging Face's own loss: `model(input_ids, labels).loss` is the
    mean over the labels HF shifts itself, so the labels given are the pre-shifted ones moved back by one."""
    ids, shifted = batch["input_ids"], batch["shift_labels"]
    labels = torch.cat([ids[:, :1], shifted[:, :-1]], dim=1)
    count = (shifted != IGNORE_INDEX).sum()
    return model(input_ids=ids, labels=labels, use_cache=False).loss * count, count


# ---- the step trial --------------------------------------------------------------------------------------------


# Rungs that run the flags as `lstune train` does. The ladder's rungs keep `auto` as the memory techniques read it on
# their own (ALST's tile counts), so each rung adds its technique whatever the estimate would pick.
TRAIN_AS_IS = ("lstune", "sp")


def run_step_trial(job: Job) -> dict[str, Any]:
    """The record of `job` (kind "step"); an out-of-memory error or a failure is a result, not an exception."""
    from lstune.config.schema import TrainConfig
    from lstune.train.engine_choice import runtime_cluster
    from lstune.train.metrics import host_rss_bytes
    from lstune.train.plan import plan
    from lstune.train.runtime import start_runtime

    config = TrainConfig.from_flat(job.config)
    runtime = start_runtime(config.model.dtype)
    # The plan `lstune train` makes, for the memory this trial may use (its host cap, --max-host-mem). A ladder
    # rung runs its `auto` settings unresolved (ALST's tile counts): its plan is of that.
    run_plan = plan(config, runtime_cluster(runtime, job.host_cap), runtime.device.type,
                    resolve_auto=job.rung in TRAIN_AS_IS)
    runtime.use_dims(run_plan.dims)
    record: dict[str, Any] = {"world_size": runtime.world_size, "sp": runtime.sp, "device": str(runtime.device)}
    record["estimate"] = estimate_summary(run_plan.estimate, config, run_plan.spec.config)
    record["hardware"] = run_plan.cluster.to_dict()
    try:
        loader = _loader(config, runtime, run_plan.spec)  # before the baseline: --data's tokenizer and samples aren't the step's
        record["rss_before_model"] = host_rss_bytes()
        steps = _train_steps(job, run_plan, runtime, loader)
    except Exception as exc:  # a failure is a result too: the parent records it and goes on
        record.update(failure(exc))
    else:
        record.update(outcome="ok", **summarise_steps(steps, job.warmup))
    record.update(_peaks(runtime.device, record))
    return record


def _train_steps(job: Job, run_plan, runtime, loader) -> list[dict[str, Any]]:
    from lstune.parallel.sp_data import SPDataAdapter
    from lstune.train.step import RunState, Stepper

    total = job.warmup + job.steps
    engine, loss_sum, chunks = (_plain_hf if job.plain_hf else _lstune)(run_plan, runtime, total)
    # SP shards as `lstune train` lays them out for this model's chunked attention.
    batches = iter(SPDataAdapter(loader, runtime.dims, device=runtime.device, chunks=chunks))
    stepper = Stepper(run_plan.resolved, engine, runtime, loss_sum)
    state = RunState()
    return [stepper.step(batches, state) for _ in range(total)]


def _plain_hf(run_plan, runtime, total: int):
    """Hugging Face as it comes: SDPA, HF gradient checkpointing (non-reentrant), HF's loss; the model (RoPE,
    4-bit base, dtypes), LoRA via peft and the device / dtype policy as `lstune train` (lstune.train.build), so the
    two differ only in what lstune adds."""
    from lstune.optim import OptimConfig
    from lstune.train.build import load_weights
    from lstune.train.engine import TorchEngine
    from lstune.train.prepare import adapt_model

    config = run_plan.config
    loaded = load_weights(run_plan, runtime, attn_implementation="sdpa")
    model = adapt_model(loaded.model, config.model, runtime)
    enable_hf_checkpointing(model)
    model.train()
    engine = TorchEngine(model, OptimConfig.from_section(config.optim, total))
    return engine, lambda batch, m: hf_loss_sum(batch, m), None


def enable_hf_checkpointing(model) -> None:
    """HF's own gradient checkpointing, non-reentrant (`activation_checkpointing_enable` from transformers 5.2x,
    which deprecates the older name)."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def _lstune(run_plan, runtime, total: int):
    """`lstune train`'s model and engine, built as train builds them (lstune.train.build: load, adapt, techniques in
    their order, the plan's engine) but for the self-check (train's startup check, not the step measured); returns
    (engine, loss function, the chunked attention SP shards are laid out for), as `_plain_hf` (no chunks)."""
    from lstune.train.build import build

    built = build(run_plan, runtime, max_steps=total, self_check=False)
    return built.engine, built.prepared.loss_sum, built.prepared.memory.attn_chunking


def _loader(config, runtime, spec):
    """Each rank's loader of full-length batches as `lstune train` reads them: random tokens, or --data."""
    from lstune.data.loader import make_dataloader
    from lstune.estimate.shapes import text_config

    if config.data.source is None:
        dataset = RandomTokens(text_config(spec.config).vocab_size, config.data.seq_len, seed=config.optim.seed)
    else:
        dataset = _data(config, spec)
    loader = make_dataloader(dataset, config.optim.micro_batch_size, seed=config.optim.seed,
                             dp_rank=runtime.rank, dp_size=runtime.world_size)
    return loader


def _data(config, spec):
    from lstune.data.dataset import build_dataset
    from lstune.data.templates import set_chat_template
    from lstune.data.tokenizer import load_model_tokenizer

    source = spec.source
    tokenizer, _ = load_model_tokenizer(source.kind, source.location, name=source.name,
                                        vocab_size=spec.config.vocab_size,
                                        trust_remote_code=config.model.trust_remote_code)
    set_chat_template(tokenizer, config.data.chat_template)
    return build_dataset(config.data.source, tokenizer, config.data.seq_len, pack=config.data.pack,
                         seed=config.optim.seed, max_records=config.data.max_records, **config.data.reading())


def summarise_steps(steps: list[dict[str, Any]], warmup: int) -> dict[str, Any]:
    """Times and losses of the timed steps (those after `warmup`), peaks over all of them."""
    timed = steps[warmup:]
    times = [s["step_time_s"] for s in timed]
    return {
        "step_times_s": times, "warmup_times_s": [s["step_time_s"] for s in steps[:warmup]],
        "median_s": statistics.median(times), "min_s": min(times),
        "losses": [s["loss"] for s in steps], "tokens_per_step": timed[0]["tokens"],
        "peak_allocated": max(s["peak_device_mem_bytes"] for s in timed),
    }


def _peaks(device, record: dict[str, Any]) -> dict[str, Any]:
    """Device peaks (CUDA: torch's allocator; CPU: the process's peak RSS less its RSS before the model was
    built, the bytes the run itself took) and the process's peak RSS."""
    from lstune.train.metrics import host_peak_rss_bytes

    peaks = {"peak_rss": host_peak_rss_bytes()}
    if device.type == "cuda":
        peaks["peak_reserved"] = int(torch.cuda.max_memory_reserved(device))
        peaks["device_total"] = int(torch.cuda.get_device_properties(device).total_memory)
        peaks["device_name"] = torch.cuda.get_device_name(device)
        if "peak_allocated" not in record:  # a failed step: the peak it reached before failing
            peaks["peak_allocated"] = int(torch.cuda.max_memory_allocated(device))
    else:
        baseline = record.get("rss_before_model")
        peaks["peak_allocated"] = max(0, peaks["peak_rss"] - baseline) if baseline is not None else None
        peaks["peak_reserved"] = None
    return peaks


def failure(exc: BaseException) -> dict[str, Any]:
    """An out-of-memory error (CUDA's, or the CPU allocator's) or any other failure, as a record."""
    message = str(exc).strip()
    text = message.splitlines()[0][:300] if message else type(exc).__name__
    oom = isinstance(exc, (torch.OutOfMemoryError, MemoryError)) or (
        isinstance(exc, RuntimeError) and ("can't allocate memory" in message or "out of memory" in message.lower()))
    record = {"outcome": "oom" if oom else "error", "error": f"{type(exc).__name__}: {text}"}
    if not oom:
        record["traceback"] = traceback.format_exc(limit=-6)[-3000:]
    return record


def estimate_summary(prediction, config, model_config) -> dict[str, Any]:
    """The estimate's numbers for one optimizer step (each rank processes grad_accum × SP micro-batches, each
    one sample's FLOPs shared by the SP group). The hardware FLOPs come split by the kernel that runs them — dense
    matmuls, attention forwards (recompute included), attention backward — so that the ideal step can time each
    part at its own measured rate (lstune.bench.metrics)."""
    from lstune.estimate.flops import kernel_flops

    # The estimate's step already counts every micro-batch a rank runs (grad_accum × SP, lstune.estimate): its
    # FLOPs are one SP group's, so the step's total is theirs times the data-parallel groups.
    flops = prediction.flops
    samples = prediction.hardware.world_size // prediction.sp
    run, bare = kernel_flops(flops, model_config, config.data.seq_len)
    return {
        "device_peak_bytes": prediction.device_peak_bytes, "host_peak_bytes": prediction.host_peak_bytes,
        "step_seconds": prediction.step_seconds, "fits": prediction.fits,
        "engine": prediction.engine.describe(), "longest_seq_len": prediction.longest_seq_len,
        "model_flops": flops.model * samples, "hardware_flops": flops.hardware * samples,
        "hardware_matmul_flops": flops.hardware_matmul * samples,
        "hardware_attention_flops": flops.hardware_attention * samples,
        "hardware_attention_forward_flops": run.attention_forward * samples,
        "hardware_attention_backward_flops": run.attention_backward * samples,
        # The same step with no recompute (lstune.estimate.flops.kernel_flops): the "× ideal" without recompute.
        "model_matmul_flops": bare.matmul * samples, "model_attention_forward_flops": bare.attention_forward * samples,
        "peak_tflops": prediction.hardware.device.peak_tflops, "device_capacity": prediction.device_capacity,
    }


# ---- the other jobs ----------------------------------------------------------------------------------------------


def run_estimates(job: Job) -> dict[str, Any]:
    """The estimate of `job.config` at each of `job.lengths` on this machine (the plots' lines)."""
    from lstune.config.schema import TrainConfig
    from lstune.estimate import estimate
    from lstune.models.loading import resolve_model
    from lstune.train.engine_choice import runtime_cluster
    from lstune.train.runtime import start_runtime

    config = TrainConfig.from_flat(job.config)
    model_config = resolve_model(config.model.name, trust_remote_code=config.model.trust_remote_code).config
    cluster = runtime_cluster(start_runtime(config.model.dtype), job.host_cap)  # the trials' memory
    if config.parallel.gpus > 1:
        from dataclasses import replace

        cluster = replace(cluster, gpus=config.parallel.gpus)
    points = []
    for n in job.lengths:
        # reach=False: the line needs each length's peaks and time, not the longest length (the same numbers; the
        # search made 24 points take 121 s on the H100 machine of 2026-11-28, ~4 s each, against ~0.3 s without)
        e = estimate(TrainConfig.from_flat({**job.config, "seq_len": n}), cluster, model_config=model_config,
                     suggest=False, reach=False)
        points.append({"seq_len": n, "device_peak_bytes": e.device_peak_bytes, "host_peak_bytes": e.host_peak_bytes,
                       "step_seconds": e.step_seconds})  # every micro-batch of the step counted
    return {"outcome": "ok", "points": points}


def run_job(job: Job) -> dict[str, Any]:
    start = time.perf_counter()
    if job.kind == "step":
        record = run_step_trial(job)
    elif job.kind == "estimates":
        record = run_estimates(job)
    elif job.kind == "rates":
        from lstune.bench.rates import measure_rates

        record = {"outcome": "ok", "rates": measure_rates()}
    else:
        raise ValueError(f"unknown job kind {job.kind!r}")
    record["seconds"] = time.perf_counter() - start
    return record


def run_to_file(job: Job, result_path: str) -> None:
    """A trial process's body: run `job`, write its record to `result_path` (rank 0 only, atomically)."""
    from lstune.parallel.comm import close_process_group

    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    try:
        record = run_job(job)
    except Exception as exc:
        record = failure(exc)
    if int(os.environ.get("RANK", "0")) == 0:
        from lstune.train.atomic import write_text_new

        write_text_new(Path(result_path), json.dumps(record, default=str))
    # Only after a trial that went well on this rank: after a failure another rank may be stuck in a collective and
    # never reach the barrier (the record is written either way; the parent reads it, not the exit code).
    if record.get("outcome") == "ok":
        close_process_group()


def main(argv: list[str] | None = None) -> None:
    """`python -m lstune.bench.trial JOB.json RESULT.json` (each process of a launched trial runs this)."""
    from lstune.parallel.lifetime import die_with_launcher

    die_with_launcher()  # ends with its launcher, which ends with the bench
    job_path, result_path = argv if argv is not None else sys.argv[1:]
    run_to_file(Job(**json.loads(Path(job_path).read_text())), result_path)


if __name__ == "__main__":
    main()
