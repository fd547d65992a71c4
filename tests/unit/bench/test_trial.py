"""A trial's step, in this process: plain Hugging Face and lstune train the same model to the same losses on the
same random tokens (fp32 CPU), and a failure is a record, not an exception."""

from __future__ import annotations

import pytest
import torch

from lstune.bench.rungs import RUNGS, rung_config
from lstune.bench.trial import Job, RandomTokens, failure, run_step_trial
from lstune.config.schema import TrainConfig


def _job(rung: str, **flat) -> Job:
    config = rung_config(TrainConfig.from_flat({"model": "tiny-llama", "seq_len": 192, **flat}), RUNGS[rung])
    return Job(1, "step", rung, config.to_dict(), plain_hf=RUNGS[rung].plain_hf, warmup=1, steps=2)


@pytest.mark.parametrize("flat", [{}, {"lora_r": 4}], ids=["full", "lora"])
def test_plain_hf_and_lstune_give_the_same_losses_on_the_same_tokens(flat):
    hf = run_step_trial(_job("hf", **flat))
    ours = run_step_trial(_job("lstune", **flat))
    assert hf["outcome"] == ours["outcome"] == "ok", (hf.get("error"), ours.get("error"))
    assert len(hf["losses"]) == 3 and hf["losses"][0] > 5.0  # ~ln(320): random tokens
    # Three steps: the same first loss (same weights, same tokens), and the same updates after it.
    assert ours["losses"] == pytest.approx(hf["losses"], rel=1e-5)
    assert len(ours["step_times_s"]) == 2 and ours["median_s"] > 0 and ours["tokens_per_step"] == 192
    assert ours["estimate"]["model_flops"] > 0 and ours["peak_allocated"] >= 0


def test_random_tokens_follow_the_batch_contract_and_repeat():
    data = RandomTokens(320, 16, seed=3)
    sample = data[5]
    assert sample["input_ids"].max() < 320 and torch.equal(sample["position_ids"], torch.arange(16))
    assert torch.equal(sample["shift_labels"][:-1], sample["input_ids"][1:]) and sample["shift_labels"][-1] == -100
    assert torch.equal(data[5]["input_ids"], RandomTokens(320, 16, seed=3)[5]["input_ids"])
    assert not torch.equal(data[5]["input_ids"], data[6]["input_ids"])


def test_out_of_memory_and_other_failures_are_told_apart():
    assert failure(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB"))["outcome"] == "oom"
    assert failure(RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried"))["outcome"] == "oom"
    try:
        raise ValueError("a bug")
    except ValueError as exc:
        record = failure(exc)
    assert record["outcome"] == "error" and record["error"] == "ValueError: a bug" and "a bug" in record["traceback"]


def test_the_estimate_line_has_each_lengths_full_estimate_without_the_longest_length_search():
    """The plots' line takes each length's peaks and step time — the numbers `lstune estimate` gives — without the
    longest-length search the line never shows (~4 s a point for Llama-3.1-8B: 2 of a lease's 15 minutes)."""
    from lstune.bench.trial import run_estimates
    from lstune.estimate import estimate
    from lstune.train.engine_choice import runtime_cluster
    from lstune.train.runtime import start_runtime

    config = TrainConfig.from_flat({"model": "tiny-llama", "seq_len": 1024})
    points = run_estimates(Job(1, "estimates", "lstune", config.to_dict(), lengths=[1024, 4096]))["points"]
    cluster = runtime_cluster(start_runtime(config.model.dtype), None)
    for point in points:
        full = estimate(TrainConfig.from_flat({**config.to_dict(), "seq_len": point["seq_len"]}), cluster,
                        suggest=False)
        assert full.longest_seq_len > 0  # the full estimate searched; the line's numbers are its numbers
        assert (point["device_peak_bytes"], point["host_peak_bytes"], point["step_seconds"]) == (
            full.device_peak_bytes, full.host_peak_bytes, full.step_seconds)
