"""What a measured step means: tokens/s, TFLOP/s, MFU, and how far the estimate was from it.

The FLOPs are lstune.estimate.flops's (one counter for the estimate and the bench; docs/bench.md gives the
formula): `model_flops` of a step count forward and backward of every matmul and of causal attention once —
a frozen weight (LoRA's base, the head) forward and input gradient only — and are the MFU numerator, as
torchtitan and the PaLM paper count them; `hardware_flops` add what is run again (checkpointing's second
forward, the tiled MLP's and the tiled loss's recompute, attention's backward recompute).

    model TFLOP/s per device = model_flops / median step time / devices / 1e12
    MFU                      = model TFLOP/s per device / the device's bf16 dense peak (lstune.estimate.hardware)

The step time is the median of the timed steps; tokens/s counts every token of the step on every device.

With the kernel rates (`--rates`, lstune.bench.rates), the ideal step: the step at the speed of its kernels alone,
each part of its hardware FLOPs at the rate measured on the same machine for the kernel that runs it —

    ideal_s  = (matmul / GEMM rate + attention forwards / forward rate + attention backward / backward rate) / devices
    vs_ideal = median step time / ideal_s

the GEMM rate over every measured shape (their FLOPs over their seconds), the attention rates those measured at the
length nearest the trial's. Recompute (checkpointing's, the tiled MLP's and loss's) counts as lstune runs it; what
the hardware FLOPs leave out (elementwise ops, norms, copies, the optimizer) does not.
"""

from __future__ import annotations

from typing import Any


def derive(record: dict[str, Any], rates: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The figures of a successful step record (empty for any other); the ideal step's too when `rates` were
    measured."""
    if record.get("outcome") != "ok" or "median_s" not in record:
        return {}
    est = record["estimate"]
    seconds, devices = record["median_s"], record["world_size"]
    model_tflops = est["model_flops"] / seconds / devices / 1e12
    figures = {
        "tokens_per_s": record["tokens_per_step"] / seconds,
        "model_tflops": model_tflops,
        "hardware_tflops": est["hardware_flops"] / seconds / devices / 1e12,
        "mfu": model_tflops / est["peak_tflops"],
        "estimate_peak_error_pct": percent_error(est["device_peak_bytes"], record.get("peak_allocated")),
        "estimate_time_error_pct": percent_error(est["step_seconds"], seconds),
    }
    figures.update(ideal_figures(record, rates))
    return figures


def ideal_figures(record: dict[str, Any], rates: list[dict[str, Any]] | None) -> dict[str, Any]:
    """`ideal_s`, `vs_ideal` and the attention length whose rates were used (module doc); empty without rates for
    both kinds of kernel."""
    if not rates:
        return {}
    gemm, attention = gemm_flops_per_s(rates), nearest_attention(rates, record["seq_len"])
    if gemm is None or attention is None:
        return {}
    est = record["estimate"]
    seconds = (est["hardware_matmul_flops"] / gemm
               + est["hardware_attention_forward_flops"] / (attention["fwd_tflops"] * 1e12)
               + est["hardware_attention_backward_flops"] / (attention["bwd_tflops"] * 1e12)) / record["world_size"]
    return {"ideal_s": seconds, "vs_ideal": record["median_s"] / seconds, "ideal_attention_len": attention["seq"]}


def gemm_flops_per_s(rates: list[dict[str, Any]]) -> float | None:
    """The measured GEMMs' FLOPs over their seconds: each shape weighted by its FLOPs (a step's matmuls are of
    many shapes; the large ones take most of its time)."""
    gemms = [r for r in rates if r["op"] == "gemm"]
    if not gemms:
        return None
    return sum(2 * m * k * n for m, k, n in (r["shape"] for r in gemms)) / sum(r["seconds"] for r in gemms)


def nearest_attention(rates: list[dict[str, Any]], seq_len: int) -> dict[str, Any] | None:
    """The attention rates measured at the length nearest `seq_len` (a kernel's rate depends on the length)."""
    measured = [r for r in rates if r["op"] == "attention_causal"]
    return min(measured, key=lambda r: abs(r["seq"] - seq_len), default=None)


def percent_error(predicted: float | None, measured: float | None) -> float | None:
    """(predicted − measured) / measured in %: positive when the estimate says more than was measured."""
    if predicted is None or not measured:
        return None
    return 100.0 * (predicted - measured) / measured
