"""The bench's plots (matplotlib, Agg backend, imported here only):

- longest.png: the longest sequence each configuration completes a step at (bars), with --find-max-len;
- peak-vs-length.png: peak memory against length, measured (points) and the estimate's (a line per
  configuration, same colour), with the capacity the trials had;
- tokens-per-s.png: throughput against length.
A plot with nothing to show is not written. Each is claimed in the folder's record before it is written
(lstune.bench.outputs).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lstune.bench.outputs import BenchFolder
from lstune.config.parse import format_length
from lstune.train.atomic import write_new

GIB, MIB = 2**30, 2**20
COLOURS = ["#7f7f7f", "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b"]


def write_plots(result, folder: BenchFolder) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    written = []
    for name, draw in (("longest.png", _longest), ("peak-vs-length.png", _peaks), ("tokens-per-s.png", _throughput)):
        fig = draw(result)
        if fig is not None:
            folder.claim(folder.path / name)
            written.append(_save(fig, folder.path / name))
    return written


def labels(result) -> dict[str, str]:
    return {r["name"]: r["label"] for r in result.rungs}


def _title(result) -> str:
    config = result.rungs[0]["config"]
    lora = f"LoRA r={config['lora_r']}" if config["lora_r"] else "full fine-tune"
    gpu = result.fingerprint["gpus"]
    where = f"{gpu[0]['name']}" if gpu else "CPU"
    return f"{config['model']}, {lora}, {where}"


def _colours(result) -> dict[str, str]:
    return {r["name"]: COLOURS[i % len(COLOURS)] for i, r in enumerate(result.rungs)}


def _k(n: float) -> float:
    return n / 1024


def _longest(result):
    """One bar per configuration, named under it (wrapped, so neighbours' names never overlap); its value above it,
    and a hatched bar marked "≥ cap" where the search stopped at --max-len rather than at a failure."""
    import textwrap

    import matplotlib.pyplot as plt

    if not result.searches:
        return None
    name, colour = labels(result), _colours(result)
    rungs = list(result.searches)
    values = [_k(result.searches[r]["longest_ok"]) for r in rungs]
    capped = [bool(result.searches[r].get("capped")) for r in rungs]
    fig, ax = plt.subplots(figsize=(max(6.0, 1.5 * len(rungs) + 2), 4.8))
    bars = ax.bar(range(len(rungs)), values, color=[colour[r] for r in rungs], width=0.6,
                  hatch=["//" if c else "" for c in capped], edgecolor="white")
    for bar, value, cap in zip(bars, values, capped):
        text = f"≥ {value:g}K\n(cap)" if cap else f"{value:g}K"
        ax.annotate(text, (bar.get_x() + bar.get_width() / 2, value), ha="center", va="bottom", fontsize=8,
                    xytext=(0, 2), textcoords="offset points")
    ax.set_xticks(range(len(rungs)), ["\n".join(textwrap.wrap(name.get(r, r), 14)) for r in rungs], fontsize=8)
    ax.set_ylabel("longest sequence completing a step (K tokens)")
    step = next(iter(result.searches.values()))["len_step"]
    title = f"{_title(result)}\nlongest sequence completing a step (resolution {format_length(step)} tokens)"
    if any(capped):
        title += "\nhatched: reached the --max-len cap (longer may fit)"
    ax.set_title(title, fontsize=9)
    ax.set_ylim(0, max(values + [1]) * 1.3)
    fig.tight_layout()
    return fig


def _ok_steps(result, rung: str) -> list[dict[str, Any]]:
    return [t for t in result.trials if t.get("kind") == "step" and t.get("rung") == rung and t.get("outcome") == "ok"]


def _peaks(result):
    import matplotlib.pyplot as plt

    cuda = bool(result.fingerprint["gpus"])
    points = {r["name"]: sorted((t["seq_len"], t["peak_allocated"]) for t in _ok_steps(result, r["name"])
                                if t.get("peak_allocated") is not None) for r in result.rungs}
    if not any(points.values()):
        return None
    top = max(p for pts in points.values() for _, p in pts)
    unit, unit_name = (GIB, "GiB") if top >= 2 * GIB else (MIB, "MiB")
    name, colour = labels(result), _colours(result)
    fig, ax = plt.subplots(figsize=(11, 5))
    for rung, pts in points.items():
        if pts:
            ax.plot([_k(s) for s, _ in pts], [p / unit for _, p in pts], "o", color=colour[rung],
                    label=f"{name.get(rung, rung)}, measured")
        line = result.estimates.get(rung) or []
        if line:
            ax.plot([_k(p["seq_len"]) for p in line], [p["device_peak_bytes"] / unit for p in line], "--",
                    color=colour[rung], lw=1, label=f"{name.get(rung, rung)}, estimate")
    capacity = _capacity(result)
    if capacity:
        ax.axhline(capacity[0] / unit, color="k", lw=0.8, ls=":", label=capacity[1])
    ax.set_xlabel("sequence length (K tokens)")
    ax.set_ylabel(f"peak device memory ({unit_name})" if cuda else
                  f"peak memory of the trial ({unit_name}; CPU: RSS above the process's start)")
    ax.set_title(f"{_title(result)}\npeak memory per step: measured and estimated")
    ax.set_ylim(0, top / unit * 1.15)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return fig


def _capacity(result) -> tuple[float, str] | None:
    gpu = result.fingerprint["gpus"]
    if gpu:
        return gpu[0]["memory_bytes"], f"device memory ({gpu[0]['memory_bytes'] / GIB:.0f} GiB)"
    return None


def _throughput(result):
    import matplotlib.pyplot as plt

    name, colour = labels(result), _colours(result)
    series = {r["name"]: _throughputs(result, r["name"]) for r in result.rungs}
    if not any(series.values()):
        return None
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for rung, pts in series.items():
        if pts:
            ax.plot([_k(s) for s, _ in pts], [v for _, v in pts], "o-", color=colour[rung], label=name.get(rung, rung))
    ax.set_xlabel("sequence length (K tokens)")
    ax.set_ylabel("throughput (tokens/s, all devices)")
    ax.set_title(f"{_title(result)}\ntraining throughput (median timed step; search trials: their 2nd step)")
    ax.set_ylim(bottom=0)
    ax.set_xlim(left=0)
    ax.legend(fontsize=8)
    return fig


def _throughputs(result, rung: str) -> list[tuple[int, float]]:
    """(length, tokens/s) of every successful step trial of `rung`; a measurement wins over a search trial."""
    by_length: dict[int, float] = {}
    for t in sorted(_ok_steps(result, rung), key=lambda t: t.get("purpose") == "measure"):
        if "tokens_per_s" in t:
            by_length[t["seq_len"]] = t["tokens_per_s"]
    return sorted(by_length.items())


def _save(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    try:
        return write_new(path, lambda f: fig.savefig(f, format="png", dpi=110))
    finally:
        plt.close(fig)
