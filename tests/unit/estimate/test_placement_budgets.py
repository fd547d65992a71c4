"""The checkpoint placement's default budgets (issue 14, MEMO): the estimate caps the host at the machine's usable
memory (its RAM less what the OS keeps: 4 GiB + 1 %) less the margin a fit keeps (4 % of it, issue 32) and, when the host cannot hold every checkpoint, the device at its headroom — one choice (MemoryChoice) that
`lstune estimate` shows and `lstune train` applies. Llama-3.1-8B LoRA, bf16 checkpoints of 8 KiB per token per
layer: at 256K tokens 2 GiB each, 31 of them offloadable (the last layer's stays on the device)."""

from __future__ import annotations

from lstune.config.schema import TrainConfig
from lstune.estimate import AUTO_HEADROOM, device_capacity, estimate, host_capacity
from lstune.estimate.settings import host_limit
from lstune.estimate.hardware import resolve_hardware
from lstune.estimate.memory import HOST_PROCESS_BYTES

GiB = 2**30
CKPT = 256 * 1024 * 4096 * 2  # one layer's checkpoint at 256K tokens: 2 GiB


def _host_for(limit_gib: float) -> float:
    """The host RAM (GiB) whose usable part less the margin is `limit_gib` (issue 32 changed the hosts below to keep
    the behaviour each test is about: 68, 52 GiB limits were 68/0.99 and 52/0.99 GiB hosts before the margin)."""
    return (limit_gib / 0.96 + 4) / 0.99


def _estimate(host_gib: float, **flat):
    config = TrainConfig.from_flat({"model": "llama-3.1-8b", "seq_len": 256 * 1024, "lora_r": 16,
                                    "offload_checkpoints": True, "zero_stage": "0", **flat})
    return estimate(config, resolve_hardware(gpu="h100-80gb", host_mem=int(host_gib * GiB)), suggest=False)


def test_the_os_keeps_4_gib_and_1_percent_of_the_host():
    e = _estimate(125)
    assert host_capacity(e.hardware) == 125 * GiB - 4 * GiB - int(1.25 * GiB) == e.host_capacity


def test_a_host_that_holds_every_checkpoint_needs_no_device_budget():
    """71.4 GiB host, AdamW on the device: 64 GiB usable within the margin, less the process's 2 GiB = 62 GiB = the
    31 checkpoints."""
    e = _estimate(_host_for(64))
    choice, placement = e.memory_choice, e.breakdown.placement
    assert choice.host_mem_budget == host_limit(e.hardware) - HOST_PROCESS_BYTES
    assert 31 * CKPT <= choice.host_mem_budget < 31 * CKPT + GiB
    assert choice.checkpoint_device_budget is None
    assert placement.describe() == "host 0-30; device 31" and e.fits
    assert ("checkpoint budgets: host 62.0 GiB (the host's usable 64.0 GiB within the margin less 2.0 GiB else on it)"
            in choice.describe())


def test_a_host_that_holds_one_checkpoint_less_gets_a_device_budget():
    """The same host less 1.5 GiB: 30 checkpoints and a part of the 31st on the host, and a device budget."""
    e = _estimate(_host_for(64) - 1.5)
    assert 30 * CKPT < e.breakdown.placement.host_bytes() < 31 * CKPT
    assert e.memory_choice.checkpoint_device_budget is not None


def test_a_small_host_gets_a_plan_host_first_then_the_device_headroom_then_recompute():
    """54.6 GiB host, 48 GiB of it usable within the margin: 46 GiB hold 23 checkpoints (layers 0-22); the device budget is 90% of the device less everything
    else at its highest phase; the planner recomputes 4 of the 8 layers left so that the device part (5 stored, one
    fetched back, one recomputed segment's input: 7 × 2 GiB = 14 GiB) fits it. Without the cap the run needed 64 GiB
    of host and did not fit (longest sequence 188K, host-bound); now it fits, and so do longer ones."""
    e = _estimate(_host_for(48))
    choice, placement = e.memory_choice, e.breakdown.placement
    assert choice.host_mem_budget == host_limit(e.hardware) - HOST_PROCESS_BYTES
    assert 46 * GiB <= choice.host_mem_budget < 46 * GiB + 2**20
    headroom = int(AUTO_HEADROOM * device_capacity(e.hardware)) - e.breakdown.device_besides_checkpoints
    assert choice.checkpoint_device_budget == headroom
    assert placement.describe() == "host 0-22; device 23, 25, 27, 29, 31; recompute 24, 26, 28, 30"
    assert placement.host_bytes() == 23 * CKPT and placement.device_peak_bytes() == 7 * CKPT <= headroom
    assert e.fits and e.fits_host and e.longest_seq_len > 256 * 1024
    data = e.to_dict()
    assert data["checkpoint_placement"]["extra_recompute_pct"] > 0
    assert data["memory_choice"]["host_mem_budget"] == choice.host_mem_budget
    assert data["memory_choice"]["checkpoint_device_budget"] == headroom


def test_a_large_host_holds_everything():
    e = _estimate(2048)
    usable = 2048 * GiB - 4 * GiB - int(20.48 * GiB)
    assert e.memory_choice.host_mem_budget == usable - int(0.04 * usable) - HOST_PROCESS_BYTES
    assert e.memory_choice.checkpoint_device_budget is None
    assert e.breakdown.placement.describe() == "host 0-30; device 31"


def test_the_users_budgets_win():
    e = _estimate(48, host_mem_budget=100 * GiB, checkpoint_device_budget=4 * GiB)
    assert e.memory_choice.host_mem_budget == 100 * GiB and e.memory_choice.checkpoint_device_budget == 4 * GiB
    assert "checkpoint budgets" not in e.memory_choice.reason
    assert not e.fits_host  # the user's budget is more than the machine has: the estimate says so


def test_without_offload_no_budget_is_added():
    e = _estimate(48, offload_checkpoints=False)
    assert e.memory_choice.host_mem_budget is None and e.memory_choice.checkpoint_device_budget is None
    assert e.breakdown.placement is None
