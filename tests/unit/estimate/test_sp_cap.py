"""More GPUs than Ulysses can use (issue 32): Llama-3.1-8B's 32 query heads stop `--sp auto` at 32, so 64 GPUs run
SP 32 × DP 2 — the same step time as 32 GPUs and twice the tokens a second — and the estimate says so."""

from __future__ import annotations

from lstune.config.schema import TrainConfig
from lstune.estimate import estimate
from lstune.estimate.hardware import resolve_hardware


def _estimate(gpus: int, **flat):
    config = TrainConfig.from_flat({"model": "llama-3.1-8b", "seq_len": 1 << 20, "gpus": gpus, **flat})
    return estimate(config, resolve_hardware(gpu="h100-80gb", gpus=gpus), suggest=False, reach=False)


def test_gpus_past_the_heads_run_data_parallel_with_the_same_step_time_and_a_note_saying_why():
    at_32, at_64 = _estimate(32), _estimate(64)
    assert (at_32.sp, at_64.sp) == (32, 32)
    assert at_64.step_seconds == at_32.step_seconds
    assert at_64.tokens_per_second == 2 * at_32.tokens_per_second
    assert not any("SP stops" in note for note in at_32.notes)
    note = next(note for note in at_64.notes if "SP stops" in note)
    assert "SP stops at 32 of the 64 GPUs" in note and "32" in note and "DP 2" in note and "--sp-ring" in note


def test_a_given_sp_degree_gets_no_note():
    e = _estimate(64, sp=16)
    assert e.sp == 16 and not any("SP stops" in note for note in e.notes)
