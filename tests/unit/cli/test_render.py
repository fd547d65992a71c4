"""The progress display at the widths people use (80, 100, 200 columns) and in a pipe (cluster logs)."""

from __future__ import annotations

import io
import re

import pytest
from rich.console import Console

from lstune.cli.render import RichReporter, StepClock, human_duration

PLAN = {"model": "tiny-llama (preset)", "steps": 60, "start_step": 0}


def _metrics(step: int, **extra) -> dict:
    return {"step": step, "loss": 2.5, "lr": 1e-3, "grad_norm": 0.5, "tokens_per_s": 12345.0, "step_time_s": 30.0,
            "peak_device_mem_bytes": 3 * 2**30, "host_rss_bytes": 5 * 2**30, **extra}


def _run(width: int, terminal: bool, log_every: int = 1, steps: int = 3) -> str:
    out = io.StringIO()
    con = Console(file=out, width=width, force_terminal=terminal, color_system=None, highlight=False)
    reporter = RichReporter(con, log_every=log_every)
    reporter.start(PLAN)
    for step in range(1, steps + 1):
        reporter.phase("forward layer 2/4")
        reporter.step(_metrics(step, **({"eval_loss": 2.25, "eval_ppl": 9.49, "eval_time_s": 0.0} if step == 2 else {})))
    reporter.end(None)
    return re.sub(r"\x1b\[[0-9;?]*[a-zA-Z]", "", out.getvalue())


@pytest.mark.parametrize("width", [80, 100, 200])
def test_terminal_bar_keeps_count_elapsed_and_eta_at_every_width(width):
    text = _run(width, terminal=True)
    lines = text.splitlines()
    at = max(i for i, line in enumerate(lines) if "train" in line and "/60" in line)
    last = lines[at]
    assert "3/60" in last and "eta 0:28:30" in last, last  # 57 steps left × 30 s
    assert re.search(r"\d:\d\d:\d\d", last.split("3/60")[1])  # elapsed time after the count
    assert len(last.rstrip()) <= width
    assert "forward layer 2/4" in last


@pytest.mark.parametrize("width", [80, 100])
def test_every_metric_stays_on_the_live_display_at_80_and_100_columns(width):
    """The metrics sit under the bar, on as many lines as the width needs, never cut (issue 38: at 80 columns
    the one-line bar lost all but the loss)."""
    lines = _run(width, terminal=True).splitlines()
    at = max(i for i, line in enumerate(lines) if "train" in line and "3/60" in line)
    below = lines[at + 1:at + 4]
    shown = " ".join(below)
    for metric in ("loss 2.5000", "mem 3.0 GiB", "rss 5.0 GiB", "12,345 tok/s", "30.00 s/step", "lr 1.0e-03",
                   "gnorm 0.50"):
        assert metric in shown, (metric, below)
    assert all(len(line.rstrip()) <= width for line in lines), [line for line in lines if len(line.rstrip()) > width]
    assert "…" not in shown


def test_status_lines_break_between_metrics_only():
    from lstune.cli.render import status_lines

    assert status_lines(["loss 2.5000", "mem 3.0 GiB", "lr 1.0e-03"], 26) == ["loss 2.5000 · mem 3.0 GiB", "lr 1.0e-03"]


def test_pipe_lines_have_total_eta_and_eval_loss():
    lines = [line for line in _run(120, terminal=False).splitlines() if re.match(r"step +\d", line)]
    assert len(lines) == 3
    assert lines[0].startswith("step     1/60  eta 0:29:30")
    assert "eval_loss 2.2500" in lines[1] and "eval_loss" not in lines[2]
    assert lines[2].endswith("rss 5.0 GiB"), "a log line is never folded or cut"


def test_log_every_keeps_lines_in_a_terminal_and_thins_them_in_a_pipe():
    kept = [line for line in _run(120, terminal=True, log_every=2, steps=4).splitlines() if re.match(r"step +\d", line)]
    assert [line.split()[1] for line in kept] == ["2/60", "4/60"]
    piped = [line for line in _run(120, terminal=False, log_every=2, steps=4).splitlines() if re.match(r"step +\d", line)]
    assert [line.split()[1] for line in piped] == ["2/60", "4/60"]


def test_eta_uses_recent_step_times_including_evaluation():
    clock = StepClock(total=10, start_step=0, window=2)
    assert clock.eta(_metrics(1, step_time_s=10.0)) == pytest.approx(90.0)
    assert clock.eta(_metrics(2, step_time_s=2.0, eval_time_s=2.0)) == pytest.approx(8 * 7.0)
    assert human_duration(3725) == "1:02:05"


def test_passkey_accuracy_on_the_line_and_in_the_summary(tmp_path, capsys):
    from types import SimpleNamespace

    from lstune.cli.render import _step_line, print_summary

    m = _metrics(2, eval_loss=2.25, eval_ppl=9.49, eval_passkey_acc=0.375, tokens_seen=1, eval_time_s=0.0)
    assert "eval_loss 2.2500  eval_ppl 9.49  passkey_acc 38%" in _step_line(m, 60, 0.0)
    result = SimpleNamespace(history=[_metrics(1), m], interrupted=False, steps_done=2, max_steps=60,
                             output_dir=tmp_path, last_checkpoint=None, final_dir=None, merged_dir=None)
    print_summary(result)
    out = capsys.readouterr().out
    assert re.search(r"passkey accuracy \(step 2\) +│ +37\.5%", out) and re.search(r"validation loss \(step 2\) +│ +2\.2500", out)
