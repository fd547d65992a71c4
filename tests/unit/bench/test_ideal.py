"""The ideal step (`--rates`): the step's hardware FLOPs at the kernel rates measured on the same machine, against
hand counts; bench.md's two columns only with rates; `lstune bench --rates` end to end on tiny-llama."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lstune.bench.metrics import derive, gemm_flops_per_s, ideal_figures
from lstune.bench.report import measurement_table
from lstune.bench.run import BenchResult
from lstune.estimate.flops import attention_split, kernel_flops, step_flops
from lstune.models.presets import preset_config
from tests.integration.conftest import cli  # noqa: F401  (the fixture: `lstune` in this process)


def _gemm(m: int, k: int, n: int, seconds: float) -> dict:
    return {"op": "gemm", "shape": [m, k, n], "dtype": "torch.bfloat16", "seconds": seconds,
            "tflops": 2 * m * k * n / seconds / 1e12}


def _attention(seq: int, fwd_s: float, bwd_s: float) -> dict:
    """A rate record as lstune.bench.rates writes it (32 / 8 heads of 128; backward FLOPs 2.5 × forward's)."""
    flops = 2 * seq * seq * 32 * 128
    return {"op": "attention_causal", "seq": seq, "heads": 32, "kv_heads": 8, "head_dim": 128,
            "dtype": "torch.bfloat16", "fwd_s": fwd_s, "bwd_s": bwd_s, "fwd_tflops": flops / fwd_s / 1e12,
            "bwd_tflops": 2.5 * flops / bwd_s / 1e12}


def _step(seq_len: int, median_s: float, world_size: int, matmul: float, forward: float, backward: float) -> dict:
    est = {"model_flops": matmul, "hardware_flops": matmul + forward + backward, "peak_tflops": 989.0,
           "hardware_matmul_flops": matmul, "hardware_attention_flops": forward + backward,
           "hardware_attention_forward_flops": forward, "hardware_attention_backward_flops": backward,
           "device_peak_bytes": 2**30, "step_seconds": median_s}
    return {"outcome": "ok", "kind": "step", "purpose": "measure", "rung": "lstune", "seq_len": seq_len,
            "median_s": median_s, "min_s": median_s, "world_size": world_size, "tokens_per_step": seq_len,
            "estimate": est}


# Two GEMMs: 2e9 FLOPs in 4 ms (0.5 TFLOP/s), 4e9 in 2 ms (2 TFLOP/s): 6e9 in 6 ms, 1 TFLOP/s (the mean of the two
# rates would be 1.25). Attention at 1000 tokens: forward 2·1000²·32·128 = 8.192e9 FLOPs in 16.384 ms (0.5 TFLOP/s),
# backward 2.5 × that in 81.92 ms (0.25 TFLOP/s); at 4000 tokens 2 and 1 TFLOP/s.
RATES = [_gemm(1000, 1000, 1000, 0.004), _gemm(2000, 1000, 1000, 0.002),
         _attention(1000, 0.016384, 0.08192), _attention(4000, 0.065536, 0.32768)]


def test_the_ideal_step_is_each_kernels_flops_at_its_rate():
    assert gemm_flops_per_s(RATES) == pytest.approx(1e12)
    # 2400 tokens: nearer 1000 than 4000. On 2 devices: (3e12 / 1e12 + 1e12 / 0.5e12 + 0.5e12 / 0.25e12) / 2 = 3.5 s.
    record = _step(2400, 5.0, 2, matmul=3e12, forward=1e12, backward=0.5e12)
    figures = ideal_figures(record, RATES)
    assert figures["ideal_attention_len"] == 1000
    assert figures["ideal_s"] == pytest.approx(3.5)
    assert figures["vs_ideal"] == pytest.approx(5.0 / 3.5)
    # At 3000 tokens the 4000-token rates (2 and 1 TFLOP/s): (3 + 0.5 + 0.5) / 2 = 2 s.
    assert ideal_figures(_step(3000, 5.0, 2, 3e12, 1e12, 0.5e12), RATES)["ideal_s"] == pytest.approx(2.0)
    assert derive(record, RATES)["ideal_s"] == pytest.approx(3.5)


def test_no_ideal_without_rates_of_both_kernels_or_for_a_failed_step():
    record = _step(2400, 5.0, 2, 3e12, 1e12, 0.5e12)
    assert "ideal_s" not in derive(record) and ideal_figures(record, None) == {}
    assert ideal_figures(record, RATES[:2]) == {} and ideal_figures(record, RATES[2:]) == {}
    assert derive({"outcome": "oom"}, RATES) == {}


def _result(trials: list[dict], rates: list[dict] | None) -> BenchResult:
    return BenchResult("lstune bench", Path("."), {"gpus": []}, {}, [{"name": "lstune", "label": "lstune"}],
                       trials=trials, rates=rates)


def test_bench_md_shows_the_ideal_columns_only_with_rates():
    step = _step(2400, 5.0, 2, 3e12, 1e12, 0.5e12)
    ok = {**step, **derive(step, RATES), "peak_allocated": 2**30}
    failed = {"outcome": "oom", "kind": "step", "purpose": "measure", "rung": "lstune", "seq_len": 4096,
              "error": "CUDA out of memory"}
    with_rates = measurement_table(_result([ok, failed], RATES))
    header, rule, row, failed_row = with_rates[2:6]
    assert header.endswith("| ideal step (s) | × ideal | ideal, no recompute (s) | × ideal, no recompute |")
    assert rule.count("|") == header.count("|") == 18
    # This record has no no-recompute split (bench.json from before 2026-11-27): dashes there.
    assert row.endswith("| 3.5 | 1.43 | — | — |") and row.count("|") == 18
    assert failed_row.count("|") == 18 and "oom" in failed_row
    assert any(line.startswith("Ideal step:") for line in with_rates)

    without = measurement_table(_result([{**ok, "ideal_s": None}, failed], None))
    assert "ideal" not in "\n".join(without) and without[2].count("|") == without[4].count("|") == 14
    # Rates that could not time this trial (a failed rates run keeps none): a dash in each column.
    no_attention = measurement_table(_result([{**step, **derive(step, RATES[:2]), "peak_allocated": 1}], RATES[:2]))
    assert no_attention[4].endswith("| — | — | — | — |")


def test_the_h200_reference_run():
    """Llama-3.1-8B, LoRA r=16, 131072 tokens, tiled loss and checkpointing on, no tiled MLP (lstune's defaults on
    an H200: it fits without), with the rates that H200 measured; its step took 50.717 s. By hand: attention A =
    32 layers × 4·128·32 × 131072·131073/2 = 4.5036e15; forward + checkpointing's = 2A at 549.76 TFLOP/s
    (2·131072²·32·128 FLOPs in 0.256 s) = 16.384 s; backward 2.5A at 542.88 TFLOP/s = 20.739 s; matmuls 5.9459e15
    at 755.71 TFLOP/s (the 4 GEMMs' 1.8692e13 FLOPs in 24.734 ms) = 7.868 s. Ideal 44.991 s, the run's README's;
    measured 1.127 × that. Without recompute (the model FLOPs' matmuls, 3.968e15 = 5.251 s; one attention forward,
    8.192 s; the kernel's backward as before, 20.739 s): 34.18 s, 1.484 × (issue 32's figure)."""
    config, seq = preset_config("llama-3.1-8b"), 131072
    flops = step_flops(config, seq, lora=True, lora_r=16, checkpointing=True, tiled_mlp=False, tiled_loss=True)
    forward, backward = attention_split(flops, config, seq)
    attention = 32 * 4 * 128 * 32 * (seq * (seq + 1) // 2)
    assert (forward, backward) == (2 * attention, 2.5 * attention)
    assert flops.hardware_matmul == pytest.approx(5.9459e15, rel=1e-4)
    rates = [_gemm(8192, 8192, 8192, 0.001397), _gemm(65536, 4096, 14336, 0.00954),
             _gemm(65536, 14336, 4096, 0.0105), _gemm(65536, 4096, 4096, 0.003297),
             _attention(131072, 0.256, 0.6481), _attention(32768, 0.01411, 0.04128)]
    assert gemm_flops_per_s(rates) == pytest.approx(755.71e12, rel=1e-5)
    step = _step(seq, 50.717, 1, flops.hardware_matmul, forward, backward)
    run, bare = kernel_flops(flops, config, seq)
    assert (run.matmul, run.attention_forward, run.attention_backward) == (flops.hardware_matmul, forward, backward)
    assert bare.attention_forward == attention and bare.attention_backward == backward
    step["estimate"].update(model_matmul_flops=bare.matmul, model_attention_forward_flops=bare.attention_forward)
    figures = ideal_figures(step, rates)
    assert figures["ideal_s"] == pytest.approx(44.991, abs=1e-3)
    assert figures["vs_ideal"] == pytest.approx(1.1273, abs=1e-4)
    assert bare.matmul == pytest.approx(3.968e15, rel=1e-3)
    assert figures["ideal_no_recompute_s"] == pytest.approx(34.18, abs=0.01)
    assert figures["vs_ideal_no_recompute"] == pytest.approx(1.484, abs=1e-3)


def test_bench_with_rates_reports_the_ideal_end_to_end(cli, tmp_path):  # noqa: F811
    out = tmp_path / "b"
    result = cli("bench", "--model", "tiny-llama", "--seq-len", "256", "--warmup", "0", "--steps", "1", "--rates",
                 "--output-dir", out)
    assert result.code == 0, result.err + result.out
    bench = json.loads((out / "bench.json").read_text())
    m = bench["measurements"][0]
    assert m["outcome"] == "ok" and bench["rates"] and m["ideal_attention_len"] == 256  # the CPU rates' one length
    est = m["estimate"]
    assert est["hardware_matmul_flops"] + est["hardware_attention_flops"] == pytest.approx(est["hardware_flops"])
    assert est["hardware_attention_forward_flops"] + est["hardware_attention_backward_flops"] == pytest.approx(
        est["hardware_attention_flops"])
    assert m["ideal_s"] > 0 and m["vs_ideal"] == pytest.approx(m["median_s"] / m["ideal_s"])
    assert m["ideal_no_recompute_s"] < m["ideal_s"]
    assert m["vs_ideal_no_recompute"] == pytest.approx(m["median_s"] / m["ideal_no_recompute_s"])
    assert m["hfu"] >= m["mfu"] > 0
    assert "| ideal step (s) | × ideal | ideal, no recompute (s) | × ideal, no recompute |" in (out / "bench.md").read_text()
