"""`lstune bench` on a CUDA device: trials forked from the forkserver get a working device of their own (the
forkserver never initialises CUDA), plain HF and lstune measure with torch's allocator peaks, the fingerprint
names the GPU, and the search finds a length on the device."""

from __future__ import annotations

import json

import pytest

from lstune.bench.options import parse_options
from lstune.bench.run import run_bench
from lstune.config.load import build_config

pytestmark = pytest.mark.gpu


def test_bench_on_cuda_measures_both_rungs_with_allocator_peaks_and_rates(tmp_path):
    config = build_config({}, {"model": "tiny-llama", "seq_len": "2k", "lora_r": "8"})
    options, problems = parse_options({"rungs": "hf,lstune", "lengths": "1k,2k", "steps": "2", "rates": True,
                                       "find_max_len": True, "len_step": "1k", "max_len": "8k",
                                       "output_dir": str(tmp_path / "b")})
    assert not problems
    result = run_bench(config, options, command="lstune bench (test)")
    assert result.fingerprint["gpus"] and result.fingerprint["gpus"][0]["memory_bytes"] > 2**30
    for m in result.measurements():
        assert m["outcome"] == "ok", m.get("error")
        assert m["device"].startswith("cuda") and 0 < m["peak_allocated"] <= m["peak_reserved"]
        assert 0 < m["mfu"] < 1 and m["estimate_peak_error_pct"] is not None
    assert all(s["longest_ok"] == 8192 for s in result.searches.values())  # a tiny model fits 8K easily
    assert result.rates and all(r.get("tflops", r.get("fwd_tflops", 0)) > 1 for r in result.rates)
    bench = json.loads((tmp_path / "b" / "bench.json").read_text())
    assert bench["measurements"][0]["peak_reserved"] > 0
