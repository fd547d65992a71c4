"""`run_bench(config, options)`: measure the chosen configurations, search their longest sequences, write the
results. The CLI (lstune.cli.bench) parses and renders; everything else is here.

Order: the kernel rates (--rates), then per configuration its --find-max-len search and its measurements
at each of --lengths (default --seq-len), then the estimate's line for the plots; bench.json, bench.md and
the plots last (lstune.bench.report). Every trial is a fresh process (lstune.bench.runner); an observer
hears each one start, tick and finish. The output folder is checked before the first trial, and every name
written there is recorded as the bench's first (lstune.bench.outputs).
"""

from __future__ import annotations

import itertools
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from lstune.bench.options import BenchOptions
from lstune.bench.outputs import BenchFolder, check_folder
from lstune.bench.rungs import Rung, rung_config, same_as, select_rungs
from lstune.config.schema import TrainConfig
from lstune.errors import ConfigError, UserError
from lstune.train.signals import Terminated

CPU_DEFAULT_CAP = 0.8  # of this machine's RAM: a CPU search stops there rather than at the kernel's OOM killer
CURVE_POINTS = 24


class Observer(Protocol):
    def started(self, job) -> None: ...

    def tick(self, job, elapsed_s: float, rss_bytes: int) -> None: ...

    def finished(self, job, record: dict[str, Any]) -> None: ...


class _Quiet:
    def started(self, job) -> None:
        pass

    def tick(self, job, elapsed_s: float, rss_bytes: int) -> None:
        pass

    def finished(self, job, record: dict[str, Any]) -> None:
        pass


@dataclass
class BenchResult:
    command: str
    output_dir: Path
    fingerprint: dict[str, Any]
    options: dict[str, Any]
    rungs: list[dict[str, Any]]  # name, label, resolved config (flat)
    trials: list[dict[str, Any]] = field(default_factory=list)  # every trial, in order
    searches: dict[str, dict[str, Any]] = field(default_factory=dict)  # rung → longest sequence found
    estimates: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # rung → the estimate's line
    rates: list[dict[str, Any]] | None = None
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0
    files: list[Path] = field(default_factory=list)

    def measurements(self) -> list[dict[str, Any]]:
        return [t for t in self.trials if t.get("kind") == "step" and t.get("purpose") == "measure"]

    def to_dict(self) -> dict[str, Any]:
        return {"command": self.command, "fingerprint": self.fingerprint, "options": self.options,
                "rungs": self.rungs, "measurements": self.measurements(), "searches": self.searches,
                "estimates": self.estimates, "rates": self.rates, "trials": self.trials, "notes": self.notes,
                "seconds": self.seconds}


def plan(config: TrainConfig, options: BenchOptions) -> list[Rung]:
    """The rungs to measure; ConfigError with every problem of the choice (before anything runs)."""
    problems = problems_with(config, options)
    if problems:
        raise ConfigError(problems)
    return select_rungs(config, options.rungs, options.ablation)[0]


def problems_with(config: TrainConfig, options: BenchOptions) -> list[str]:
    """What is wrong with measuring `options` on `config`: unknown rung names, SP on one process, limits."""
    problems = select_rungs(config, options.rungs, options.ablation)[1]
    if options.max_len is not None and options.max_len < options.len_step:
        problems.append(f"--max-len {options.max_len} is shorter than --len-step {options.len_step}; raise it.")
    if (options.max_len is not None or options.len_step != BenchOptions.len_step) and not options.find_max_len:
        problems.append("--max-len and --len-step set the --find-max-len search: add --find-max-len, or drop them.")
    if config.data.data_streaming:
        problems.append("bench measures steps on data read as usual (each trial at its own length); drop "
                        "--data-streaming (a part of a large source will do: --max-records).")
    return problems


def output_dir(options: BenchOptions, config: TrainConfig) -> BenchFolder:
    """--output-dir (default runs/bench-MODEL-TIMESTAMP), checked: refuses the user's files and links at the bench's
    names, and an earlier bench's files without --overwrite (lstune.bench.outputs)."""
    if options.output_dir is not None:
        path = Path(options.output_dir)
    else:
        model = re.sub(r"[^A-Za-z0-9._-]+", "-", config.model.name).strip("-")
        path = Path("runs") / f"bench-{model}-{time.strftime('%Y%m%d-%H%M%S')}"
    return check_folder(path, overwrite=options.overwrite)


def run_bench(config: TrainConfig, options: BenchOptions, *, command: str, observer: Observer | None = None,
              fingerprint: dict[str, Any] | None = None) -> BenchResult:
    from lstune.bench.fingerprint import fingerprint as read_fingerprint
    from lstune.bench.runner import Limits, TrialRunner

    rungs = plan(config, options)
    fp = fingerprint or read_fingerprint()
    _check_gpu_count(config, fp)
    folder = output_dir(options, config)
    observer = observer or _Quiet()
    started = time.monotonic()
    loads = [_load_average()]
    limits = Limits(options.trial_timeout, host_cap(options, fp))
    runner = TrialRunner(limits, folder.path / "trials", cuda=bool(fp["gpus"]), on_tick=observer.tick,
                         claim=folder.claim)
    configs = {r.name: rung_config(config, r, in_ladder=options.ablation) for r in rungs}
    result = BenchResult(command, folder.path, fp, _options_view(options, limits),
                         [{"name": r.name, "label": r.label, "config": configs[r.name].to_dict()} for r in rungs])
    session = _Session(runner, observer, result, limits.max_host_mem)
    try:
        if options.rates:
            result.rates = session.run("rates", "rates", config).get("rates")
        for rung in rungs:
            _measure_rung(session, rung, configs[rung.name], options, config)
        for rung in rungs:
            curve = session.run("estimates", rung.name, configs[rung.name], lengths=_curve_lengths(result, rung.name))
            result.estimates[rung.name] = curve.get("points", [])
        loads.append(_load_average())
        result.notes += load_notes(loads, fp)
    except (Terminated, KeyboardInterrupt) as exc:  # a bench stopped part-way keeps what it measured
        what = "SIGTERM" if isinstance(exc, Terminated) else "Ctrl-C"
        result.notes.append(f"Interrupted ({what}) during trial {len(result.trials) + 1}: only the trials before it "
                            "are here.")
        _finish(result, config, rungs, folder, started)
        raise BenchInterrupted(f"{what} received: bench stopped; its {len(result.trials)} finished trial(s) are in "
                               f"{folder.path / 'bench.json'} and bench.md.") from None
    _finish(result, config, rungs, folder, started)
    return result


class BenchInterrupted(UserError):
    """SIGTERM or Ctrl-C during a bench, after its finished trials were written: exit 130, like an interrupted
    training run."""

    exit_code = 130


def _finish(result: BenchResult, config: TrainConfig, rungs: list[Rung], folder: BenchFolder, started: float) -> None:
    from lstune.bench.report import write_outputs

    result.notes += _notes(config, rungs)
    result.seconds = time.monotonic() - started
    result.files = write_outputs(result, folder)
    folder.clear_previous()  # only once this bench's results are in place: an earlier bench's stay until then


def _check_gpu_count(config: TrainConfig, fp: dict[str, Any]) -> None:
    """On a CUDA machine, --gpus no more than the devices its processes see: the fingerprint's (nvidia-smi's) list,
    narrowed by CUDA_VISIBLE_DEVICES, which nvidia-smi ignores; on CPU, no more than the cores (--force past it)."""
    import os

    from lstune.parallel.launch import cpu_count_problems, gpu_count_problems, usable_cores

    if not fp["gpus"] and config.parallel.hostfile is None and not config.run.force:
        problems = cpu_count_problems(config.parallel.gpus, usable_cores())
        if problems:
            raise ConfigError(problems)
    if fp["gpus"] and config.parallel.hostfile is None:
        visible = len(fp["gpus"])
        if os.environ.get("CUDA_VISIBLE_DEVICES") is not None:
            visible = min(visible, len([d for d in os.environ["CUDA_VISIBLE_DEVICES"].split(",") if d.strip()]))
        problems = gpu_count_problems(config.parallel.gpus, visible)
        if problems:
            raise ConfigError(problems)


def host_cap(options: BenchOptions, fp: dict[str, Any]) -> int | None:
    if options.max_host_mem is not None:
        return options.max_host_mem
    return None if fp["gpus"] else int(CPU_DEFAULT_CAP * fp["host_ram_bytes"])


def _measure_rung(session: "_Session", rung: Rung, config: TrainConfig, options: BenchOptions, given: TrainConfig):
    """The measurements at each length, then the --find-max-len search, which takes a measurement that completed
    two steps (a warmup step and a timed one) as its probe at that length rather than running it again."""
    from lstune.bench.search import find_max_len

    measured = {n: session.run("step", rung.name, config, seq_len=n, warmup=options.warmup, steps=options.steps,
                               plain_hf=rung.plain_hf)
                for n in options.lengths or [given.data.seq_len]}
    if options.find_max_len:
        two_steps = options.warmup >= 1

        def probe(n: int) -> dict[str, Any]:
            if two_steps and measured.get(n, {}).get("outcome") == "ok":
                return measured[n]
            # Two steps: the second runs with the optimizer state the first one created (a full fine-tune's
            # Adam moments are not there during the first step's backward).
            return session.run("step", rung.name, config, seq_len=n, purpose="search", warmup=1, steps=1,
                               plain_hf=rung.plain_hf)

        found = find_max_len(probe, start=given.data.seq_len, step=options.len_step, max_len=options.max_len)
        session.result.searches[rung.name] = found.to_dict()


class _Session:
    """Numbers the jobs, runs each through the runner, tells the observer, adds the derived figures."""

    def __init__(self, runner, observer: Observer, result: BenchResult, host_cap: int | None = None):
        self.runner, self.observer, self.result = runner, observer, result
        self.host_cap = host_cap  # each trial's host memory (--max-host-mem): what its plan sizes `auto` for
        self.ids = itertools.count(1)

    def run(self, kind: str, rung: str, config: TrainConfig, *, seq_len: int | None = None, lengths=(),
            **job_fields: Any) -> dict[str, Any]:
        from lstune.bench.metrics import derive
        from lstune.bench.trial import Job

        values = config.to_dict()
        if seq_len is not None:
            values["seq_len"] = seq_len
        job = Job(next(self.ids), kind, rung, values, lengths=list(lengths), host_cap=self.host_cap, **job_fields)
        self.observer.started(job)
        record = self.runner.run(job)
        record.update(derive(record, self.result.rates))
        self.result.trials.append(record)
        self.observer.finished(job, record)
        return record


def _curve_lengths(result: BenchResult, rung: str) -> list[int]:
    """Lengths for the estimate's line of `rung`: from near zero to a quarter past the longest one tried."""
    tried = [t["seq_len"] for t in result.trials if t.get("rung") == rung and t.get("kind") == "step"]
    top = int(max(tried, default=4096) * 1.25)
    step = max(64, top // CURVE_POINTS // 64 * 64)
    return list(range(step, top + step, step))


def _options_view(options: BenchOptions, limits) -> dict[str, Any]:
    from dataclasses import asdict

    view = asdict(options)
    view["max_host_mem_applied"] = limits.max_host_mem
    return view


def _load_average() -> float | None:
    import os

    return os.getloadavg()[0] if hasattr(os, "getloadavg") else None


def load_notes(loads: list[float | None], fp: dict[str, Any]) -> list[str]:
    """A note when other work loaded the machine's CPUs while the trials ran (1-minute load average at the start and
    the end past the usable cores): the step times then follow that load as much as the configurations (seen on a
    2-core machine shared six ways: plain HF's steps 29 times lstune's, from the load alone)."""
    known = [load for load in loads if load is not None]
    cores = fp.get("cpu_cores_usable") or fp.get("cpu_cores") or 1
    if not known or max(known) <= cores:
        return []
    return [f"the machine was loaded while the trials ran (load average {min(known):.1f} to {max(known):.1f} on "
            f"{cores} usable cores): step times and tokens/s follow that load, not only the configurations; compare "
            "them from an idle machine"]


def _notes(config: TrainConfig, rungs: list[Rung]) -> list[str]:
    notes = []
    twin = same_as(config)
    if any(r.name == "tiled_mlp" for r in rungs) and twin:
        notes.append(f"the flags' own memory settings (lstune train's with these flags) are the {twin} rung's")
    return notes
