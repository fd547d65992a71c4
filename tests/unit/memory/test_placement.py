"""Checkpoint placement (MEMO): every plan shape equals plain checkpointing; memory follows the plan; the planner.

Exactness runs 6-layer tiny models in fp32 on CPU so a plan can hold host layers, device layers, split layers and
recomputed segments at once; each is compared with plain per-layer checkpointing (no offloader) and with HF.
"""

from __future__ import annotations

import pytest
import torch

from lstune.config.schema import MemorySection
from lstune.errors import ConfigError
from lstune.memory import checkpoint as ckpt
from lstune.memory.apply import apply_memory_techniques
from lstune.memory.measure import LiveBytes
from lstune.memory.patching import run_undos
from lstune.memory.placement import CheckpointPlacement, hiding_fraction, plan_placement
from lstune.models.introspect import decoder_layers
from lstune.models.presets import build_model
from tests.unit.memory._helpers import assert_grads_match, hf_loss_sum, long_batch, packed_batch, run_grads

N = 6
SEQ = 96
HIDDEN = 128  # tiny-llama
PLANS = {
    "all_host": (1.0, 1.0, 1.0, 1.0, 1.0, 0.0),
    "mixed_host_device": (1.0, 0.0, 1.0, 0.0, 1.0, 0.0),
    "segments": (1.0, None, None, 0.0, None, 0.0),
    "alpha_half": (0.5, 0.5, None, 0.5, None, 0.0),
}
BATCHES = {"long": lambda: [long_batch(SEQ)], "packed": lambda: [packed_batch([41, 33, 22])]}


def _with_placement(model, fractions, *, budget=None):
    layers = decoder_layers(model)
    offloader = ckpt.CheckpointOffloader(len(layers), host_mem_budget=budget,
                                         placement=CheckpointPlacement(tuple(fractions)))
    return offloader, ckpt.install_checkpointing(layers, offloader)


def _grads(model, batches, fractions=None, seed=0):
    offloader, undos = _with_placement(model, fractions) if fractions else (None, ckpt.install_checkpointing(
        decoder_layers(model), None))
    try:
        torch.manual_seed(seed)
        return run_grads(model, hf_loss_sum, batches), offloader
    finally:
        run_undos(undos)


@pytest.mark.parametrize("data", sorted(BATCHES))
@pytest.mark.parametrize("arch", ["tiny-llama", "tiny-qwen3", "tiny-gemma2"])
def test_every_plan_shape_equals_plain_checkpointing(arch, data):
    model = build_model(arch, num_hidden_layers=N)
    model.train()
    batches = BATCHES[data]()
    (ref_loss, ref_grads), _ = _grads(model, batches)
    hf_loss, hf_grads = run_grads(model, hf_loss_sum, batches)
    assert ref_loss == pytest.approx(hf_loss, rel=1e-6)
    for name, fractions in PLANS.items():
        (loss, grads), offloader = _grads(model, batches, fractions)
        assert loss == pytest.approx(ref_loss, rel=1e-6), name
        assert_grads_match(grads, ref_grads, rtol=1e-5)
        assert offloader.stats.host_bytes == 0, name  # every host copy released after backward
        # One extra layer forward per layer not stored (a segment is re-run once, its inputs kept).
        assert offloader.stats.recomputed_in_backward == fractions.count(None), name


def test_recomputed_segments_replay_dropout_exactly():
    """Dropout masks in a re-run segment are the forward's (its RNG state is restored per layer)."""
    model = build_model("tiny-llama", num_hidden_layers=N, attention_dropout=0.3)
    model.train()
    batches = [long_batch(SEQ)]
    (ref_loss, ref_grads), _ = _grads(model, batches, seed=7)
    (other_loss, _), _ = _grads(model, batches, seed=8)
    assert other_loss != pytest.approx(ref_loss, rel=1e-6)  # dropout is really on
    (loss, grads), offloader = _grads(model, batches, PLANS["segments"], seed=7)
    assert offloader.stats.recomputed_in_backward == 3
    assert loss == pytest.approx(ref_loss, rel=1e-6)
    assert_grads_match(grads, ref_grads, rtol=1e-5)


def _retained_after_forward(fractions, seq=256):
    """Bytes the graph keeps after forward outside the offloader's host copies, and the host bytes."""
    model = build_model("tiny-llama", num_hidden_layers=N)
    offloader, undos = _with_placement(model, fractions)
    try:
        with LiveBytes() as live:
            loss, _ = hf_loss_sum(model, long_batch(seq))
            host = offloader.stats.host_bytes
            device = live.current - host
        loss.backward()
        return device, host, offloader.stats.peak_host_bytes
    finally:
        run_undos(undos)


def test_device_and_host_bytes_follow_the_plan():
    one = 256 * HIDDEN * 4  # one fp32 checkpoint of 256 tokens
    base_device, base_host, _ = _retained_after_forward(PLANS["all_host"])
    assert base_host == 5 * one
    for name in ("mixed_host_device", "segments", "alpha_half"):
        plan = CheckpointPlacement(PLANS[name], one)
        device, host, peak_host = _retained_after_forward(PLANS[name])
        assert host == peak_host == plan.host_bytes(), name
        extra = plan.device_bytes() - CheckpointPlacement(PLANS["all_host"], one).device_bytes()
        assert device - base_device == pytest.approx(extra, abs=0.05 * one), name


def test_host_budget_holds_with_a_plan_that_asks_for_more():
    one = 256 * HIDDEN * 4
    model = build_model("tiny-llama", num_hidden_layers=N)
    offloader, undos = _with_placement(model, PLANS["all_host"], budget=2 * one)
    try:
        loss, _ = hf_loss_sum(model, long_batch(256))
        assert offloader.stats.host_bytes <= 2 * one and (offloader.stats.offloaded, offloader.stats.kept) == (2, 4)
        loss.backward()
    finally:
        run_undos(undos)


# The planner --------------------------------------------------------------------------------------------------

C = 1000  # bytes of one checkpoint


def test_a_host_budget_that_fits_everything_gives_todays_offload():
    assert plan_placement(8, C).host_fraction == CheckpointPlacement.offload_all(8).host_fraction
    plan = plan_placement(8, C, host_budget=7 * C, device_budget=2 * C)
    assert plan.host_fraction == (1.0,) * 7 + (0.0,)
    assert (plan.host_bytes(), plan.device_bytes(), plan.device_peak_bytes()) == (7 * C, C, 2 * C)
    assert plan.recomputed == [] and plan.notes == ()


def test_a_host_budget_that_runs_out_mid_layer_splits_that_layer():
    plan = plan_placement(4, C, host_budget=1500, tokens=100)
    assert plan.host_fraction == (1.0, 0.5, 0.0, 0.0)
    assert plan.describe() == "host 0; split 1 (α 0.50); device 2-3"


def test_a_tight_budget_recomputes_the_fewest_layers_in_even_segments():
    # 8 layers, host 2 checkpoints, device 5: with r recomputed, 8 - r stored, 2 of them on the host, and the
    # device needs the other stored ones + 1 fetched back + the longest segment (r spread over 7 - r gaps):
    # r=0: 6+1+0 = 7; r=1: 5+1+1 = 7; r=2: 4+1+1 = 6; r=3: 3+1+1 = 5 <= 5 -> three layers recomputed.
    plan = plan_placement(8, C, host_budget=2 * C, device_budget=5 * C)
    assert plan.host_fraction == (1.0, 1.0, None, 0.0, None, 0.0, None, 0.0)
    assert (plan.host_bytes(), plan.device_bytes(), plan.device_peak_bytes()) == (2 * C, 3 * C, 5 * C)
    assert plan.extra_layer_forwards() == 3 and plan.longest_segment == 1
    assert plan.summary(step_layer_forwards=32)["extra_recompute_pct"] == pytest.approx(100 * 3 / 32, abs=0.01)
    # Device 4: r=4: 2+1+2 = 5; r=5: 1+1+3 = 5 (runs of 2 and 3); r=6: 1+1+6 = 8 -> nothing fits: the least
    # device need (5) with the fewest recomputed (r=3) is kept, noted.
    tight = plan_placement(8, C, host_budget=2 * C, device_budget=4 * C)
    assert len(tight.recomputed) == 3 and tight.device_peak_bytes() == 5 * C
    assert tight.notes and "device budget is 4,000 B" in tight.notes[0]


def test_a_device_budget_nothing_fits_keeps_the_cheapest_plan_with_a_note():
    # All 4 on the device need 4C; recomputing 1 or 2 needs 3+1 or 2+2 = 4C too (the stored ones plus the re-run
    # inputs): recompute cannot help, so none is done.
    plan = plan_placement(4, C, host_budget=0, device_budget=C)
    assert plan.recomputed == [] and plan.device_peak_bytes() == 4 * C
    assert plan.notes and "device budget" in plan.notes[0]


def test_alpha_is_what_hides_under_one_layer_forward():
    # 25 GB/s, 1 ms forward: 25 MB hide; a 100 MB checkpoint puts 1/4 of its tokens on the host.
    assert hiding_fraction(100_000_000, 25e9, 1e-3) == pytest.approx(0.25)
    assert hiding_fraction(10_000_000, 25e9, 1e-3) == 1.0
    plan = plan_placement(3, 100_000_000, copy_bytes_per_s=25e9, layer_forward_s=1e-3, tokens=1000)
    assert plan.host_fraction == (0.25, 0.25, 0.0)


def test_apply_prints_the_plan_and_recomputes_past_the_device_budget():
    model = build_model("tiny-llama", num_hidden_layers=N)
    one = 64 * HIDDEN * 4
    memory = MemorySection(tiled_mlp="off", tiled_loss="off", offload_checkpoints=True, host_mem_budget=one,
                           checkpoint_device_budget=3 * one)
    plan = apply_memory_techniques(model, memory, seq_len=64)
    try:
        placed = plan.summary()["checkpoint_placement"]
        assert placed["recomputed_layers"] and placed["host_bytes"] == one
        assert placed["extra_recompute_pct"] > 0
        loss, _ = plan.loss_sum(model, long_batch(64))
        loss.backward()
        assert plan.offloader.stats.recomputed_in_backward > 0
    finally:
        plan.undo()


def test_a_bad_device_budget_is_a_config_error():
    with pytest.raises(ConfigError, match="--checkpoint-device-budget must be"):
        apply_memory_techniques(build_model("tiny-llama"), MemorySection(checkpoint_device_budget=-1), seq_len=64)
    assert MemorySection(checkpointing=False, checkpoint_device_budget=10).problems()


def test_two_forwards_before_one_backward_recompute_their_own_segments():
    """A segment re-runs from its own forward's base, not the latest forward's (e.g. two micro-batches)."""
    model = build_model("tiny-llama", num_hidden_layers=N)
    batches = [long_batch(SEQ, seed=1), long_batch(SEQ, seed=2)]

    def both(fractions):
        offloader, undos = _with_placement(model, fractions) if fractions else (None, ckpt.install_checkpointing(
            decoder_layers(model), None))
        try:
            model.zero_grad(set_to_none=True)
            losses = [hf_loss_sum(model, b)[0] for b in batches]
            sum(losses).backward()
            return [loss.item() for loss in losses], {n: p.grad.clone() for n, p in model.named_parameters()}
        finally:
            run_undos(undos)

    ref_losses, ref_grads = both(None)
    losses, grads = both(PLANS["alpha_half"])
    assert losses == pytest.approx(ref_losses, rel=1e-6)
    assert_grads_match(grads, ref_grads, rtol=1e-5)


@pytest.mark.parametrize("data", sorted(BATCHES))
@pytest.mark.parametrize("arch", ["tiny-llama", "tiny-qwen3"])
def test_a_planned_placement_with_every_technique_equals_hf(arch, data):
    """Through apply: tiled MLP, mini-sequence, tiled loss and a planned host + device + recomputed placement."""
    model = build_model(arch, num_hidden_layers=N)
    model.train()
    batches = BATCHES[data]()
    ref_loss, ref_grads = run_grads(model, hf_loss_sum, batches)
    one = SEQ * model.config.hidden_size * 4
    memory = MemorySection(tiled_mlp=3, tiled_loss=3, mini_sequence=True, offload_checkpoints=True,
                           host_mem_budget=one, checkpoint_device_budget=5 * one)
    plan = apply_memory_techniques(model, memory, seq_len=SEQ)
    try:
        # Hand-checked: r=0 needs 5 device + 1 fetched = 6; r=2 (runs of 0, 1, 1) needs 3 + 1 + 1 = 5.
        assert plan.placement.host_fraction == (1.0, 0.0, None, 0.0, None, 0.0)
        loss, grads = run_grads(model, plan.loss_sum, batches)
        assert plan.offloader.stats.recomputed_in_backward == 2 * len(batches)
    finally:
        plan.undo()
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    assert_grads_match(grads, ref_grads)
