"""The bench's files: bench.json (everything), bench.md (the tables for docs/benchmarks/), the plots
(lstune.bench.plots). Each is claimed in the folder's record, written to a temporary name and renamed, so a reader
never sees half a file (lstune.bench.outputs)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from lstune.bench.fingerprint import describe
from lstune.bench.outputs import BenchFolder
from lstune.bench.plots import GIB, MIB, labels, write_plots
from lstune.config.parse import format_length
from lstune.train.atomic import write_text_new


def write_outputs(result, folder: BenchFolder) -> list[Path]:
    json_path, md_path = folder.path / "bench.json", folder.path / "bench.md"
    folder.claim(json_path, md_path)
    files = [write_text_new(json_path, json.dumps(result.to_dict(), indent=1, default=str) + "\n"),
             write_text_new(md_path, markdown(result))]
    return files + write_plots(result, folder)


def markdown(result) -> str:
    config = result.rungs[0]["config"]
    lines = [f"# `lstune bench`: {config['model']}, LoRA r={config['lora_r']}" if config["lora_r"]
             else f"# `lstune bench`: {config['model']}, full fine-tune", "", "```", *describe(result.fingerprint),
             "```", "", f"Command: `{result.command}`", "",
             f"{len(result.trials)} trials in {result.seconds:,.0f} s; every number is in `bench.json`.", ""]
    lines += measurement_table(result)
    if result.searches:
        lines += search_table(result)
    if result.rates:
        lines += rates_table(result.rates)
    lines += trials_table(result)
    if result.notes:
        lines += ["", "Notes:", "", *[f"- {note}" for note in result.notes]]
    return "\n".join(lines) + "\n"


STEP_COLUMNS = ("configuration", "tokens", "step median / min (s)", "tokens/s", "model TFLOP/s", "MFU",
                "hardware TFLOP/s", "HFU", "peak allocated", "peak reserved", "peak host RSS",
                "estimated peak (error: allocated / reserved)", "estimated step (error)")
# With the kernel rates (--rates) only: the ideal with recompute counted as lstune runs it, and without any.
IDEAL_COLUMNS = ("ideal step (s)", "× ideal", "ideal, no recompute (s)", "× ideal, no recompute")


def measurement_table(result) -> list[str]:
    name = labels(result)
    columns = STEP_COLUMNS + (IDEAL_COLUMNS if result.rates else ())
    rows = ["## Step time, throughput, memory", "", "| " + " | ".join(columns) + " |",
            "|---|" + "---:|" * (len(columns) - 1)]
    for m in result.measurements():
        head = f"| {name.get(m['rung'], m['rung'])} | {format_length(m['seq_len'])} "
        if m.get("outcome") != "ok":
            rows.append(head + f"| {m.get('outcome')}: {_cell(m.get('error', ''))} |" + " |" * (len(columns) - 3))
            continue
        est, ideal = m["estimate"], ideal_cells(m) if result.rates else []
        rows.append(
            head + f"| {m['median_s']:.3f} / {m['min_s']:.3f} | {m['tokens_per_s']:,.0f} | {m['model_tflops']:.3g} "
            f"| {100 * m['mfu']:.1f} % | {m['hardware_tflops']:.3g} | {100 * m.get('hfu', 0):.1f} % "
            f"| {size(m.get('peak_allocated'))} | {size(m.get('peak_reserved'))} | {size(m.get('peak_rss'))} "
            f"| {size(est['device_peak_bytes'])} ({peak_errors(m)}) "
            f"| {est['step_seconds']:.3g} s ({_pct(m.get('estimate_time_error_pct'))}) |"
            + "".join(f" {cell} |" for cell in ideal))
    cuda = bool(result.fingerprint["gpus"])
    rows += ["", "Peak allocated: " + ("`torch.cuda.max_memory_allocated` (reserved: `max_memory_reserved`)" if cuda
             else "the trial process's peak RSS less its RSS before the model was built (no device on CPU)")
             + "; MFU: model FLOPs, HFU: hardware FLOPs (recompute counted), both against the device's bf16 dense "
             "peak (docs/bench.md has the FLOP count)."
             + ("" if cuda else " No estimate error on a CPU: RSS is not the device the estimate models.")]
    if result.rates:
        rows += ["", "Ideal step: the step's matmul FLOPs at the measured GEMM rate and its attention FLOPs at the "
                 "attention rates measured at the nearest length, nothing else counted (docs/bench.md) — once with "
                 "recompute as lstune runs it, once without any (the model FLOPs' matmuls, one attention forward); "
                 "× ideal: the median step over each."]
    return rows + [""]


def peak_errors(m: dict[str, Any]) -> str:
    """The estimate's error against the allocated and the reserved peak; "no device" for a CPU trial."""
    if m.get("estimate_peak_error_pct") is None and m.get("estimate_reserved_error_pct") is None:
        return "no device" if m.get("peak_allocated") else "-"
    return f"{_pct(m.get('estimate_peak_error_pct'))} / {_pct(m.get('estimate_reserved_error_pct'))}"


def ideal_cells(m: dict[str, Any]) -> list[str]:
    """The ideal steps and the measured median in their multiples (IDEAL_COLUMNS), "—" where there is none (a failed
    trial, rates without both kinds of kernel, a record without the no-recompute split)."""
    cells = []
    for ideal, times in (("ideal_s", "vs_ideal"), ("ideal_no_recompute_s", "vs_ideal_no_recompute")):
        cells += ["—", "—"] if m.get(ideal) is None else [f"{m[ideal]:.3g}", f"{m[times]:.2f}"]
    return cells


def search_table(result) -> list[str]:
    from lstune.bench.search import CAP_NOTE, longest_text

    name = labels(result)
    rows = ["## Longest sequence that completes a training step", "",
            "| configuration | longest OK | first failure | trials | why the search ended |",
            "|---|---:|---:|---:|---|"]
    for rung, s in result.searches.items():
        failure = next((t for t in result.trials if t.get("id") in s["trials"] and t["seq_len"] == s["shortest_failed"]),
                       None)
        why = f"{failure['outcome']} at {format_length(failure['seq_len'])}" if failure else CAP_NOTE
        rows.append(f"| {name.get(rung, rung)} | **{longest_text(s, format_length)}** "
                    f"| {format_length(s['shortest_failed']) if s['shortest_failed'] else '-'} | {len(s['trials'])} "
                    f"| {s['stopped'] or why} |")
    step = next(iter(result.searches.values()))["len_step"]
    return rows + ["", f"Resolution {format_length(step)}; each trial runs two steps in a fresh process.", ""]


def rates_table(rates: list[dict[str, Any]]) -> list[str]:
    rows = ["## Kernel rates", "", "| kernel | shape | seconds | TFLOP/s |", "|---|---|---:|---:|"]
    for r in rates:
        if r["op"] == "gemm":
            rows.append(f"| GEMM {r['dtype']} | {'×'.join(map(str, r['shape']))} | {r['seconds']:.4g} | "
                        f"{r['tflops']:.3g} |")
        else:
            shape = f"{format_length(r['seq'])} tokens, {r['heads']}/{r['kv_heads']} heads × {r['head_dim']}"
            rows.append(f"| causal attention forward | {shape} | {r['fwd_s']:.4g} | {r['fwd_tflops']:.3g} |")
            rows.append(f"| causal attention backward | {shape} | {r['bwd_s']:.4g} | {r['bwd_tflops']:.3g} |")
    return rows + [""]


def trials_table(result) -> list[str]:
    name = labels(result)
    rows = ["## Every trial", "", "| # | configuration | tokens | purpose | outcome | peak allocated | peak RSS | wall (s) |",
            "|---:|---|---:|---|---|---:|---:|---:|"]
    for t in result.trials:
        if t.get("kind") != "step":
            continue
        outcome = t["outcome"] if t["outcome"] == "ok" else f"{t['outcome']}: {_cell(t.get('error', ''))}"
        rss = max(t.get("peak_rss") or 0, t.get("peak_rss_sampled") or 0)
        rows.append(f"| {t['id']} | {name.get(t['rung'], t['rung'])} | {format_length(t['seq_len'])} | {t['purpose']} "
                    f"| {outcome} | {size(t.get('peak_allocated'))} | {size(rss)} | {t['wall_s']:.1f} |")
    return rows


def size(n: float | None) -> str:
    if n is None:
        return "-"
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / MIB:.1f} MiB"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:+.0f} %"


def _cell(text: str) -> str:
    return str(text).replace("|", "/").replace("\n", " ")[:80]
