"""What a measured step means: tokens/s, TFLOP/s, MFU, and how far the estimate was from it.

The FLOPs are lstune.estimate.flops's (one counter for the estimate and the bench; docs/bench.md gives the
formula): `model_flops` of a step count forward and backward of every matmul and of causal attention once —
a frozen weight (LoRA's base, the head) forward and input gradient only — and are the MFU numerator, as
torchtitan and the PaLM paper count them; `hardware_flops` add what is run again (checkpointing's second
forward, the tiled MLP's and the tiled loss's recompute, attention's backward recompute).

    model TFLOP/s per device = model_flops / median step time / devices / 1e12
    MFU                      = model TFLOP/s per device / the device's bf16 dense peak (lstune.estimate.hardware)

The step time is the median of the timed steps; tokens/s counts every token of the step on every device.
"""

from __future__ import annotations

from typing import Any


def derive(record: dict[str, Any]) -> dict[str, Any]:
    """The figures of a successful step record (empty for any other)."""
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
    return figures


def percent_error(predicted: float | None, measured: float | None) -> float | None:
    """(predicted − measured) / measured in %: positive when the estimate says more than was measured."""
    if predicted is None or not measured:
        return None
    return 100.0 * (predicted - measured) / measured
