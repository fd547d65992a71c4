"""The run at a glance: OUTPUT_DIR/metrics.png from metrics.jsonl, at the end of a run or any time with
`lstune plot OUTPUT_DIR` (also while the run goes on: it reads only whole lines).

Four panels: training and validation loss against steps (with validation passkey accuracy on a second axis
when there is one) and against tokens seen, throughput, and memory (peak device memory per step and host
RSS). matplotlib with its Agg backend, imported here only, so that no command pays for it at startup.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from lstune.config.record import read_record
from lstune.errors import UserError
from lstune.train.metrics import METRICS_FILE

PLOT_FILE = "metrics.png"
_MARK = "lstune plot"
GIB = 2**30


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The step records of a metrics.jsonl; a line cut by a crash or still being written is skipped."""
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int):
            records.append(record)
    return records


def plot_run(output_dir: Path, out: Path | None = None) -> Path:
    """Draw OUTPUT_DIR/metrics.jsonl into `out` (default OUTPUT_DIR/metrics.png); returns the PNG's path.

    The default target is replaced only when it is absent or lstune's own (named in the run record)."""
    output_dir = Path(output_dir)
    metrics_path = output_dir / METRICS_FILE
    if not metrics_path.is_file():
        raise UserError(f"{output_dir} has no {METRICS_FILE}; give the --output-dir of an lstune run.")
    records = read_metrics(metrics_path)
    if not records:
        raise UserError(f"{metrics_path} has no step yet; plot again once the run has finished a step.")
    target = Path(out) if out is not None else output_dir / PLOT_FILE
    _check_target(target, recorded=out is None and PLOT_FILE in read_record(output_dir))
    figure = draw(records, title=output_dir.resolve().name)
    tmp = target.with_name(f".tmp-{target.name}-{os.getpid()}")
    try:
        figure.savefig(tmp, format="png", dpi=110, metadata={"Software": _MARK})
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return target


def _check_target(target: Path, *, recorded: bool) -> None:
    """UserError unless `target` may be written: absent, or a plot lstune wrote (named in the run record, or
    carrying lstune's mark in its PNG text). An --out naming the user's own file is refused like the default."""
    if target.is_dir():
        raise UserError(f"--out {target} is a folder; give the PNG file to write, e.g. {target / PLOT_FILE}.")
    if not target.parent.is_dir():
        raise UserError(f"--out {target}: the folder {target.parent} does not exist; create it or choose another.")
    if target.exists() and not (recorded or _marked(target)):
        raise UserError(f"{target} exists and lstune did not write it; nothing is overwritten unasked. "
                        "Choose another file with --out.")


def _marked(path: Path) -> bool:
    """The PNG carries the text chunk `Software: lstune plot` that plot_run writes (ahead of the image data)."""
    with path.open("rb") as fh:
        head = fh.read(1 << 16)
    return head.startswith(b"\x89PNG\r\n\x1a\n") and b"tEXtSoftware\x00" + _MARK.encode() in head


def draw(records: list[dict[str, Any]], *, title: str = ""):
    """The figure (matplotlib Figure, not shown): 2 × 2 panels with labelled axes and units."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    from matplotlib.figure import Figure

    steps = [r["step"] for r in records]
    tokens = [r.get("tokens_seen", 0) for r in records]
    evals = [r for r in records if "eval_loss" in r]
    figure = Figure(figsize=(12, 8), layout="constrained")
    loss_step, loss_tokens, speed, memory = figure.subplots(2, 2).flat

    for ax, x, label in ((loss_step, steps, "step"), (loss_tokens, tokens, "tokens seen")):
        ax.plot(x, _values(records, "loss"), label="training loss", color="tab:blue")
        if evals:
            ex = [r["step"] if label == "step" else r.get("tokens_seen", 0) for r in evals]
            ax.plot(ex, [r["eval_loss"] for r in evals], "o-", label="validation loss", color="tab:orange")
        ax.set_xlabel(label)
        ax.set_ylabel("loss (nats per token)")
        ax.grid(alpha=0.3)
        ax.legend()
    accuracy = [r for r in evals if "eval_passkey_acc" in r]
    if accuracy:
        # A second axis on the step panel: retrieval can stay at 0% while the loss falls on the filler.
        acc_axis = loss_step.twinx()
        acc_axis.plot([r["step"] for r in accuracy], [100 * r["eval_passkey_acc"] for r in accuracy], "s--",
                      label="passkey accuracy (validation)", color="tab:red")
        acc_axis.set_ylabel("passkey accuracy (%)")
        acc_axis.set_ylim(-5, 105)
        acc_axis.legend(loc="center right")
    loss_step.set_title("loss vs step")
    loss_tokens.set_title("loss vs tokens")

    speed.plot(steps, _values(records, "tokens_per_s"), color="tab:green")
    speed.set_title("throughput")
    speed.set_xlabel("step")
    speed.set_ylabel("tokens / s")
    speed.set_ylim(0, 1.15 * _top(_values(records, "tokens_per_s")))
    speed.grid(alpha=0.3)

    peak = [v / GIB for v in _values(records, "peak_device_mem_bytes")]
    rss = [v / GIB for v in _values(records, "host_rss_bytes")]
    # On CPU the "device" peak is the process's peak RSS (lstune.train.metrics).
    memory.plot(steps, peak, label="peak memory per step (device; on CPU: peak RSS)")
    memory.plot(steps, rss, label="host RSS", linestyle="--")
    memory.set_title("memory")
    memory.set_xlabel("step")
    memory.set_ylabel("GiB")
    memory.set_ylim(0, 1.3 * _top(peak + rss))
    memory.grid(alpha=0.3)
    memory.legend()
    if title:
        figure.suptitle(title)
    return figure


def _values(records: list[dict[str, Any]], key: str) -> list[float]:
    """`key` of every record, NaN (a gap in the line) where a record lacks it or holds no number."""
    values = [r.get(key) for r in records]
    return [float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else math.nan for v in values]


def _top(values: list[float]) -> float:
    """The largest finite value (1 when there is none, so an axis still has a range)."""
    finite = [v for v in values if math.isfinite(v)]
    return max(finite) if finite and max(finite) > 0 else 1.0
