"""Plots and one bench.json from the .jsonl files bench_ladder.py wrote (docs/benchmarks/<date>-<gpu>/).

    python -m tools.gpu.plot_results docs/benchmarks/2026-11-23-h100
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

LABELS = {"hf": "plain HF + GC", "tiled_loss": "+ tiled loss", "tiled_mlp": "+ tiled MLP",
          "offload": "+ offloaded ckpts", "mini_seq": "+ mini-sequence"}


def load(folder: Path) -> list[dict]:
    return [json.loads(line) for path in sorted(folder.glob("raw*/bench.jsonl")) for line in path.open()]


def plot_longest(records: list[dict], path: Path) -> None:
    import matplotlib.pyplot as plt

    found = {r["rung"]: r for r in records if r["kind"] == "maxlen"}
    rungs = [r for r in LABELS if r in found]
    values = [found[r]["longest_ok"] / 1024 for r in rungs]
    fig, ax = plt.subplots(figsize=(7, 4))
    bars = ax.bar([LABELS[r] for r in rungs], values, color=["#999"] + ["#3b7dd8"] * (len(rungs) - 1))
    for bar, rung, value in zip(bars, rungs, values):
        deep = " *" if found[rung].get("as_layers") else ""
        ax.annotate(f"{value:.0f}K{deep}", (bar.get_x() + bar.get_width() / 2, value), ha="center", va="bottom")
    ax.set_ylabel("longest sequence that completes a step (K tokens)")
    ax.set_title("Llama-3.1-8B, LoRA r=16, bf16, 1x H100 80GB\n* device limit via 2 layers + 30 layers' bytes")
    plt.setp(ax.get_xticklabels(), rotation=15)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def plot_peaks(records: list[dict], path: Path) -> None:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for rung, label in LABELS.items():
        points = sorted({(r["seq"], r["peak_allocated"]) for r in records if r["kind"] == "step" and r["rung"] == rung
                         and r["layers"] == 32 and r["outcome"] == "ok" and "peak_allocated" in r})
        if points:
            ax.plot([s / 1024 for s, _ in points], [p / 2**30 for _, p in points], "o-", label=label)
    ax.axhline(79.2, color="k", ls="--", lw=0.8, label="H100 capacity (79.2 GiB)")
    ax.set_xlabel("sequence length (K tokens)")
    ax.set_ylabel("peak device memory, max_memory_allocated (GiB)")
    ax.set_title("Llama-3.1-8B LoRA r=16, 32 layers: measured peak per step")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(folder: str) -> None:
    out = Path(folder)
    records = load(out)
    fingerprint = (out / "raw1" / "fingerprint.txt").read_text().strip().splitlines()
    (out / "bench.json").write_text(json.dumps({"fingerprint": fingerprint, "records": records}, indent=1))
    plot_longest(records, out / "longest.png")
    plot_peaks(records, out / "peak-vs-length.png")


if __name__ == "__main__":
    main(sys.argv[1])
