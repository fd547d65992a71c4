"""What a measured step means: tokens/s, TFLOP/s, MFU, and how far the estimate was from it.

The FLOPs are lstune.estimate.flops's (one counter for the estimate and the bench; docs/bench.md gives the
formula): `model_flops` of a step count forward and backward of every matmul and of causal attention once —
a frozen weight (LoRA's base, the head) forward and input gradient only — and are the MFU numerator, as
torchtitan and the PaLM paper count them; `hardware_flops` add what is run again (checkpointing's second
forward, the tiled MLP's and the tiled loss's recompute, attention's backward recompute).

    model TFLOP/s per device = model_flops / median step time / devices / 1e12
    MFU                      = model TFLOP/s per device / the device's bf16 dense peak (lstune.estimate.hardware)
    HFU                      = hardware TFLOP/s per device (recompute counted) / the same peak

The step time is the median of the timed steps; tokens/s counts every token of the step on every device.

With the kernel rates (`--rates`, lstune.bench.rates), the ideal step: the step at the speed of its kernels alone,
each part of its FLOPs at the rate measured on the same machine for the kernel that runs it —

    ideal_s  = (matmul / GEMM rate + attention forwards / forward rate + attention backward / backward rate) / devices
    vs_ideal = median step time / ideal_s

the GEMM rate over every measured shape (their FLOPs over their seconds), the attention rates those measured at the
length nearest the trial's. Two ideals (lstune.estimate.flops.kernel_flops): `ideal_s` counts recompute
(checkpointing's, the tiled MLP's and loss's) as lstune runs it; `ideal_no_recompute_s` runs the model FLOPs' matmuls
and one attention forward (the attention kernel's backward, 2.5 forwards, in both). What the FLOPs leave out
(elementwise ops, norms, copies, the optimizer) counts in neither.

Memory: on CUDA the estimate is compared with the allocated peak and with the reserved one (what the allocator took
from the device, fragmentation included: what runs out first). On a CPU there is no device: a trial's RSS is not
what the estimate's device model predicts, so no error is given.
"""

from __future__ import annotations

from typing import Any

from lstune.estimate.flops import KernelFlops


def derive(record: dict[str, Any], rates: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The figures of a successful step record (empty for any other); the ideal step's too when `rates` were
    measured."""
    if record.get("outcome") != "ok" or "median_s" not in record:
        return {}
    est = record["estimate"]
    seconds, devices = record["median_s"], record["world_size"]
    model_tflops = est["model_flops"] / seconds / devices / 1e12
    hardware_tflops = est["hardware_flops"] / seconds / devices / 1e12
    device = on_device(record)
    figures = {
        "tokens_per_s": record["tokens_per_step"] / seconds,
        "model_tflops": model_tflops,
        "hardware_tflops": hardware_tflops,
        "mfu": model_tflops / est["peak_tflops"],
        "hfu": hardware_tflops / est["peak_tflops"],
        "estimate_peak_error_pct": percent_error(est["device_peak_bytes"], record.get("peak_allocated"))
        if device else None,
        "estimate_reserved_error_pct": percent_error(est["device_peak_bytes"], record.get("peak_reserved"))
        if device else None,
        "estimate_time_error_pct": percent_error(est["step_seconds"], seconds),
    }
    figures.update(ideal_figures(record, rates))
    return figures


def on_device(record: dict[str, Any]) -> bool:
    """Whether the trial ran on an accelerator (its estimate's device model then predicts a measured peak)."""
    return record.get("hardware", {}).get("device", {}).get("kind", "cuda") == "cuda" \
        and not str(record.get("device", "cuda")).startswith("cpu")


def ideal_figures(record: dict[str, Any], rates: list[dict[str, Any]] | None) -> dict[str, Any]:
    """`ideal_s`, `vs_ideal` and the attention length whose rates were used (module doc); empty without rates for
    both kinds of kernel."""
    if not rates:
        return {}
    gemm, attention = gemm_flops_per_s(rates), nearest_attention(rates, record["seq_len"])
    if gemm is None or attention is None:
        return {}
    est, devices = record["estimate"], record["world_size"]
    rate = (gemm, attention["fwd_tflops"] * 1e12, attention["bwd_tflops"] * 1e12)
    backward = est["hardware_attention_backward_flops"]
    seconds = KernelFlops(est["hardware_matmul_flops"], est["hardware_attention_forward_flops"],
                          backward).ideal_seconds(*rate) / devices
    figures = {"ideal_s": seconds, "vs_ideal": record["median_s"] / seconds, "ideal_attention_len": attention["seq"]}
    if "model_matmul_flops" in est:  # records from before 2026-11-27 lack the split
        bare = KernelFlops(est["model_matmul_flops"], est["model_attention_forward_flops"],
                           backward).ideal_seconds(*rate) / devices
        figures.update(ideal_no_recompute_s=bare, vs_ideal_no_recompute=record["median_s"] / bare)
    return figures


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
