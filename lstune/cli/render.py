"""Everything lstune draws on a terminal: progress, notes, config and summary tables (rich)."""

from __future__ import annotations

from functools import cache
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from lstune.config.parse import format_length


@cache
def console() -> Console:
    """The terminal's width when interactive; 120 columns in logs, so lines are not folded at 80."""
    import sys

    return Console(highlight=False, width=None if sys.stdout.isatty() else 120)


def human_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def print_config(config) -> None:
    import yaml

    view = config.to_dict()
    console().print("# resolved config (use as a recipe with --config)")
    console().print(yaml.safe_dump(view, sort_keys=False).rstrip(), markup=False)


def print_plan(run_plan) -> None:
    """`train --dry-run`: the resolved recipe, then the plan (layout, engine, memory, dtypes) and the verdict."""
    import yaml

    from lstune.train.plan import resolved_recipe

    c = console()
    c.print("# resolved config (use as a recipe with --config)")
    c.print(yaml.safe_dump(resolved_recipe(run_plan), sort_keys=False).rstrip(), markup=False)
    plan = run_plan.to_dict()
    memory = ", ".join(f"{key} {value}" for key, value in plan["memory"].items())
    dtypes = ", ".join(f"{key} {value}" for key, value in plan["dtypes"].items() if value is not None)
    lines = [
        f"# plan on {plan['hardware']}: {plan['model']}, {plan['seq_len']} tokens",
        f"#   layout: {plan['processes']} process(es), SP {plan['sp']} × DP {plan['dp']} on {plan['device']}"
        + (f" (SP = Ulysses {plan['ulysses']} × ring {plan['ring']})" if plan.get("ring", 1) > 1 else ""),
        f"#   engine: {plan['engine']}",
        f"#   memory: {memory}",
        f"#   ({plan['memory_reason']})",
        f"#   dtypes: {dtypes}",
        *(f"#   note: {note}" for note in plan["notes"]),
        f"#   estimate (predicted): device {human_bytes(plan['device_peak_bytes'])} of "
        f"{human_bytes(plan['device_capacity_bytes'])}, host {human_bytes(plan['host_peak_bytes'])} of "
        f"{human_bytes(plan['host_capacity_bytes'])} — {plan['verdict']}",
    ]
    c.print("\n".join(lines), markup=False)


def human_duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = int(round(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}"


def _eval_text(m: dict[str, Any]) -> str:
    if "eval_loss" not in m:
        return ""
    text = f"  eval_loss {m['eval_loss']:.4f}  eval_ppl {m['eval_ppl']:.4g}"
    return text + (f"  passkey_acc {m['eval_passkey_acc']:.0%}" if "eval_passkey_acc" in m else "")


def _step_line(m: dict[str, Any], total: int | None = None, eta: float | None = None) -> str:
    """One step as a log line (cluster jobs): its place in the run and the time left come first."""
    where = f"step {m['step']:>5}/{total}" if total else f"step {m['step']:>5}"
    return (
        f"{where}  eta {human_duration(eta)}  loss {m['loss']:.4f}{_eval_text(m)}  lr {m['lr']:.2e}  "
        f"grad_norm {m['grad_norm']:.3f}  {m['tokens_per_s']:,.0f} tok/s  {m['step_time_s']:.2f} s/step  "
        f"peak mem {human_bytes(m['peak_device_mem_bytes'])}  rss {human_bytes(m['host_rss_bytes'])}"
    )


class StepClock:
    """The run's ETA from measured step times: the mean of the recent steps (eval time included) × steps left."""

    def __init__(self, total: int, start_step: int, window: int = 20):
        self.total, self.window = total, window
        self.times: list[float] = []
        self.last_step = start_step

    def eta(self, m: dict[str, Any]) -> float:
        steps = max(1, m["step"] - self.last_step)
        self.last_step = m["step"]
        self.times.append((m["step_time_s"] + m.get("eval_time_s", 0.0)) / steps)
        recent = self.times[-self.window:]
        return sum(recent) / len(recent) * max(0, self.total - m["step"])


class RichReporter:
    """A live progress bar on a terminal; plain step lines when output is a file or pipe."""

    def __init__(self, con: Console, *, log_every: int = 1):
        self.con = con
        self.log_every = log_every
        self.progress: Progress | None = None
        self.task = None
        self.clock: StepClock | None = None

    def start(self, plan: dict[str, Any]) -> None:
        table = Table(show_header=False, box=None, pad_edge=False)
        table.add_column(style="bold")
        table.add_column()
        for key, value in plan.items():
            table.add_row(key.replace("_", " "), _format_plan_value(key, value))
        self.con.print(table)
        self.clock = StepClock(plan["steps"], plan["start_step"])
        if self.con.is_terminal:
            self.progress = _progress(self.con)
            self.progress.start()
            self.task = self.progress.add_task(
                "train", total=plan["steps"], completed=plan["start_step"], status=[], eta="-", phase="starting"
            )

    def note(self, text: str) -> None:
        style = "yellow" if text.startswith("warning:") else "cyan"
        self.con.print(f"[{style}]lstune[/{style}]: {escape(text)}", markup=True, highlight=False)

    def phase(self, text: str) -> None:
        """Where the current step is (lstune.train.phases): shown on the bar, so a minutes-long step is watchable."""
        if self.progress is not None:
            self.progress.update(self.task, phase=text)

    def step(self, metrics: dict[str, Any]) -> None:
        eta = self.clock.eta(metrics) if self.clock is not None else None
        total = self.clock.total if self.clock is not None else None
        if self.progress is not None:
            status = _status_items(metrics)
            self.progress.update(self.task, completed=metrics["step"], status=status, eta=human_duration(eta))
        # In a terminal the bar shows every step; --log-every N > 1 also keeps a line every N steps above it.
        keep_line = self.progress is None or self.log_every > 1
        if keep_line and metrics["step"] % self.log_every == 0:
            self.con.print(_step_line(metrics, total, eta), markup=False, soft_wrap=True)

    def end(self, result: Any) -> None:
        if self.progress is not None:
            self.progress.stop()


def _status_items(m: dict[str, Any]) -> list[str]:
    """The live display's metrics, one item each (never split across lines)."""
    items = [f"loss {m['loss']:.4f}"] + [item for item in _eval_text(m).split("  ") if item]
    return items + [
        f"mem {human_bytes(m['peak_device_mem_bytes'])}", f"rss {human_bytes(m['host_rss_bytes'])}",
        f"{m['tokens_per_s']:,.0f} tok/s", f"{m['step_time_s']:.2f} s/step", f"lr {m['lr']:.1e}",
        f"gnorm {m['grad_norm']:.2f}",
    ]


def status_lines(items: list[str], width: int) -> list[str]:
    """The items joined by " · ", a new line wherever the next would pass `width`: at 80 columns every metric
    is kept (two lines), where one cut line lost all but the loss."""
    lines: list[str] = []
    for item in items:
        if lines and len(lines[-1]) + 3 + len(item) <= width:
            lines[-1] += " · " + item
        else:
            lines.append(item)
    return lines


class _TrainProgress(Progress):
    """The bar's row (bar, step count, elapsed, ETA, phase: fixed widths that fit 80 columns), then the metrics
    under it on as many lines as the terminal's width needs (`status_lines`)."""

    def get_renderables(self):
        from rich.text import Text

        yield self.make_tasks_table(self.tasks)
        for task in self.tasks:
            lines = status_lines(task.fields.get("status") or [], max(20, self.console.width - 2))
            if lines:
                yield Text("\n".join("  " + line for line in lines), no_wrap=True, overflow="ellipsis")


def _progress(con: Console) -> Progress:
    from rich.table import Column

    return _TrainProgress(
        TextColumn("[bold]train"), BarColumn(bar_width=min(30, max(10, con.width // 8))), MofNCompleteColumn(),
        TimeElapsedColumn(), TextColumn("eta {task.fields[eta]}"),
        TextColumn("{task.fields[phase]}", table_column=Column(width=20, no_wrap=True, overflow="ellipsis")),
        console=con, transient=False, expand=True,
    )


def _format_plan_value(key: str, value: Any) -> str:
    if key == "seq_len":
        return f"{format_length(value)} ({value:,} tokens)"
    if key in ("parameters", "trainable_parameters"):
        return f"{value:,}"
    if isinstance(value, dict):
        return ", ".join(f"{k}={v}" for k, v in value.items())
    return str(value)


def print_summary(result) -> None:
    history = result.history
    table = Table(title="lstune train: " + ("interrupted" if result.interrupted else "done"))
    table.add_column("")
    table.add_column("", justify="right")
    table.add_row("steps", f"{result.steps_done} / {result.max_steps}")
    if history:
        first, last = history[0], history[-1]
        mean = lambda key: sum(h[key] for h in history) / len(history)  # noqa: E731
        table.add_row("loss (first → last)", f"{first['loss']:.4f} → {last['loss']:.4f}")
        table.add_row("mean tokens/s", f"{mean('tokens_per_s'):,.0f}")
        table.add_row("mean step time", f"{mean('step_time_s'):.2f} s")
        table.add_row("peak device memory", human_bytes(max(h["peak_device_mem_bytes"] for h in history)))
        table.add_row("peak host RSS", human_bytes(max(h["host_rss_bytes"] for h in history)))
        evals = [h for h in history if "eval_loss" in h]
        if evals:
            table.add_row(f"validation loss (step {evals[-1]['step']})", f"{evals[-1]['eval_loss']:.4f}")
        if evals and "eval_passkey_acc" in evals[-1]:
            table.add_row(f"passkey accuracy (step {evals[-1]['step']})", f"{evals[-1]['eval_passkey_acc']:.1%}")
    table.add_row("metrics", str(result.output_dir / "metrics.jsonl"))
    if result.last_checkpoint:
        table.add_row("last checkpoint", str(result.last_checkpoint))
    if result.final_dir:
        table.add_row("final model", str(result.final_dir))
    if result.merged_dir:
        table.add_row("merged model", str(result.merged_dir))
    console().print(table)
    if result.interrupted and result.last_checkpoint:
        console().print(f"resume with: lstune train --output-dir {result.output_dir} --resume ...(same flags)", markup=False)


def print_data_preview(preview) -> None:
    """Counts first, then the first sample: trained tokens bold, the others dim inside ⟦ ⟧ (visible in a pipe too)."""
    from rich.text import Text

    con = console()
    s = preview.summary
    con.print(f"[bold]data[/bold]: {escape(s['note'])}")
    if not s.get("streaming"):  # a stream's counts are unknown until it is read
        con.print(f"records {s['records']:,} · samples {s['samples']:,} · tokens {s['tokens']:,} · padding "
                  f"{s['padding_tokens']:,} · truncated records {s['truncated_records']:,} (tokens dropped "
                  f"{s['truncated_tokens']:,}) · skipped records {s['skipped_documents']:,}", markup=False)
    if preview.eval_summary is not None:
        con.print(f"[bold]validation[/bold]: {escape(preview.eval_summary['note'])}")
    if not preview.shown_tokens:
        return
    split = any(trained is None for _, trained in preview.runs)
    which = f"{preview.shown_tokens:,}: its start and the lead-up to the first trained token" if split else \
        f"the first {preview.shown_tokens:,}"
    con.print(f"\n[bold]first sample[/bold]: {preview.sample_tokens:,} tokens, {preview.sample_trained:,} carry a loss; "
              f"showing {which} (⟦dim⟧ = no loss)")
    text = Text()
    for chunk, trained in preview.runs:
        if trained is None:
            text.append(chunk, style="italic")
        else:
            text.append(chunk, style="bold") if trained else text.append(f"⟦{chunk}⟧", style="dim")
    con.print(text)
