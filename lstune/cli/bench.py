"""`lstune bench`: measured speed, memory and longest sequence of one or more configurations — lstune vs plain
Hugging Face vs the estimate — as bench.json, bench.md and plots.

The library answer is `lstune.bench.run.run_bench`; this module parses (the config sections' flags, like
`lstune train`, plus the bench's own options), shows the trial in progress and the summary, and nothing else.
"""

from __future__ import annotations

import inspect
import shlex
import time
from dataclasses import fields
from typing import Any

import typer

from lstune.cli.help import HelpCommand

from lstune.bench.options import BenchOptions
from lstune.cli.options import config_parameter, dataclass_parameters, given_flags, section_parameters, to_argv

HELP = (
    "Measure training steps on random tokens (or --data): step time, tokens/s, model TFLOP/s and MFU, peak "
    "device and host memory, and the estimate's error — for lstune's configuration, plain Hugging Face, or "
    "ALST's whole ladder (--ablation); with --find-max-len, each one's longest sequence.\n\n"
    "Takes every `lstune train` flag and recipe (--config). Every trial runs in a fresh process with a time "
    "limit (and a host-memory cap with --max-host-mem). Writes bench.json, bench.md and PNG plots to "
    "--output-dir. docs/bench.md explains the numbers."
)
SECTIONS = ("model", "data", "memory", "parallel", "optim")


def register(app: typer.Typer) -> None:
    command = _bench_command
    command.__signature__ = inspect.Signature(
        [config_parameter(), *dataclass_parameters(BenchOptions), *section_parameters(SECTIONS)])
    app.command("bench", help=HELP, no_args_is_help=False, cls=HelpCommand)(command)


def _bench_command(**kwargs: Any) -> int:
    from lstune.bench.options import parse_options
    from lstune.bench.run import run_bench
    from lstune.cli.train import model_problems, refuse
    from lstune.config.load import build_config, read_recipe

    config_path = kwargs.pop("config")
    own = {f.name: kwargs.pop(f.name) for f in fields(BenchOptions)}
    options, problems = parse_options(own)
    flags = given_flags(kwargs)
    recipe = read_recipe(config_path) if config_path else {}
    config = build_config(recipe, flags, recipe_name=str(config_path or "the recipe"),
                          checks=lambda c: _cheap_problems(c, options, problems))
    # What `lstune train` refuses from these flags before loading anything, a trial would only record as an
    # error: refused here, before any trial. Once the cheap checks pass: it reads the model's config.
    refuse(model_problems(config, device=_trial_device()))
    command = shlex.join(["lstune", "bench", *to_argv(flags, config_path), *_own_argv(own)])
    live = LiveTrials()
    with live:
        result = run_bench(config, options, command=command, observer=live)
    render_summary(result)
    return 0


def _cheap_problems(config, options: BenchOptions, option_problems: list[str]) -> list[str]:
    """The bench's options, the configurations asked for, and train's preflight (the model name and --data
    resolve): nothing here imports torch or transformers, so bad input answers in about a second."""
    from lstune.bench.run import problems_with
    from lstune.train.preflight import preflight_problems

    chosen = problems_with(config, options) if not option_problems else []
    return option_problems + chosen + preflight_problems(config)


def _trial_device() -> str:
    """Where the trials train, read as the bench reads it (nvidia-smi): the parent never starts CUDA."""
    from lstune.bench.fingerprint import gpus

    return "cuda" if gpus() else "cpu"


def _own_argv(own: dict[str, Any]) -> list[str]:
    argv = []
    for name, value in own.items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            argv.append(flag if value else f"--no-{flag[2:]}")
        elif value is not None:
            argv += [flag, str(value)]
    return argv


class LiveTrials:
    """The trial in progress (a spinner with its elapsed time and memory) and one line per finished trial."""

    def __init__(self):
        from lstune.cli.render import console

        self.console = console()
        self.status = None
        self.started_at = time.monotonic()

    def __enter__(self):
        self.status = self.console.status("starting the trial processes (torch, transformers: once) ...")
        self.status.__enter__()
        return self

    def __exit__(self, *exc):
        self.status.__exit__(*exc)

    def started(self, job) -> None:
        self.status.update(f"trial {job.id}: {job.describe()} ...")

    def tick(self, job, elapsed_s: float, rss_bytes: int) -> None:
        from lstune.cli.render import human_bytes

        self.status.update(f"trial {job.id}: {job.describe()} — {elapsed_s:,.0f} s, host RSS {human_bytes(rss_bytes)}")

    def finished(self, job, record: dict[str, Any]) -> None:
        from rich.markup import escape

        ok = record.get("outcome") == "ok"
        mark = "[green]✓[/green]" if ok else "[red]✗[/red]"
        self.console.print(f"{mark} trial {job.id}: {escape(job.describe())}: {escape(outcome_text(record))}")


def outcome_text(record: dict[str, Any]) -> str:
    from lstune.bench.report import size

    if record.get("outcome") != "ok":
        return f"{record.get('outcome')} — {record.get('error', '')}"[:200]
    if record.get("kind") != "step":
        return f"done in {record.get('wall_s', 0):.1f} s"
    return (f"{record['median_s']:.3f} s/step, {record['tokens_per_s']:,.0f} tokens/s, MFU {100 * record['mfu']:.1f} %, "
            f"peak {size(record.get('peak_allocated'))} (estimate {size(record['estimate']['device_peak_bytes'])})")


def render_summary(result) -> None:
    from rich.table import Table

    from lstune.bench.report import ideal_cells, peak_errors, size
    from lstune.cli.render import console
    from lstune.config.parse import format_length

    con, names = console(), {r["name"]: r["label"] for r in result.rungs}
    table = Table(title="measured", title_justify="left")
    extra = ("ideal step", "× ideal", "ideal, no recompute", "× ideal, no recompute") if result.rates else ()
    for column in ("configuration", "tokens", "step (median)", "tokens/s", "MFU", "HFU", "peak",
                   "estimate (error: allocated / reserved)", *extra):
        table.add_column(column, justify="left" if column == "configuration" else "right")
    for m in result.measurements():
        row = [names.get(m["rung"], m["rung"]), format_length(m["seq_len"])]
        if m.get("outcome") == "ok":
            row += [f"{m['median_s']:.3f} s", f"{m['tokens_per_s']:,.0f}", f"{100 * m['mfu']:.1f} %",
                    f"{100 * m.get('hfu', 0):.1f} %", size(m.get("peak_allocated")),
                    f"{size(m['estimate']['device_peak_bytes'])} ({peak_errors(m)})"]
            row += ideal_cells(m) if extra else []
        else:
            row += [m.get("outcome", "?"), "", "", "", "", ""] + [""] * len(extra)
        table.add_row(*row)
    con.print(table)
    if result.searches:
        from lstune.bench.search import longest_text

        found = Table(title="longest sequence completing a step", title_justify="left")
        for column in ("configuration", "longest OK", "first failure", "trials"):
            found.add_column(column, justify="left" if column == "configuration" else "right")
        for rung, s in result.searches.items():
            found.add_row(names.get(rung, rung), longest_text(s, format_length),
                          format_length(s["shortest_failed"]) if s["shortest_failed"] else "-", str(len(s["trials"])))
        con.print(found)
    for note in result.notes:
        con.print(f"[yellow]note[/yellow]: {note}")
    con.print(f"{len(result.trials)} trials in {result.seconds:,.0f} s; written: "
              + ", ".join(str(p) for p in result.files))
