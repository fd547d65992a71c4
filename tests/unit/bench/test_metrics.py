"""MFU and TFLOP/s from the estimate's FLOP counter, against a hand count for tiny-llama (docs/bench.md)."""

from __future__ import annotations

import pytest

from lstune.bench.metrics import derive, percent_error
from lstune.bench.trial import estimate_summary
from lstune.config.schema import TrainConfig
from lstune.estimate import estimate
from lstune.estimate.hardware import resolve_hardware
from lstune.models.presets import preset_config

GiB = 2**30


def _hand_count(s: int, r: int) -> tuple[float, float]:
    """(model FLOPs, hardware FLOPs) of one LoRA step of tiny-llama (hidden 128, 4 q / 2 kv heads of 32,
    intermediate 352, vocab 320, 4 layers) over s tokens: checkpointing, tiled MLP and tiled loss on."""
    model, hardware, _ = _hand_count_with_attention(s, r)
    return model, hardware


def _hand_count_with_attention(s: int, r: int) -> tuple[float, float, float]:
    """`_hand_count` and the FLOPs of one forward of attention over the s tokens, all layers."""
    h, layers = 128, 4
    layer_fwd = 2 * (h * 128 + 2 * h * 64 + 128 * h + 3 * h * 352) * s * layers  # q, k, v, o, gate/up/down
    head_fwd = 2 * h * 320 * s
    attention_fwd = layers * 4 * 32 * 4 * (s * (s + 1) // 2)  # QKᵀ and PV over the causal pairs
    adapters = layers * 2 * r * s * ((h + 128) + 2 * (h + 64) + (128 + h) + 3 * (h + 352))
    # Frozen weights: forward + input gradient; adapters: forward, input and weight gradients; attention 1 + 2.
    model = 2 * (layer_fwd + head_fwd) + 3 * adapters + 3 * attention_fwd
    recompute = layer_fwd + adapters + 2 * 3 * h * 352 * s * layers + head_fwd  # checkpoint, MLP tiles, loss tiles
    hardware = 2 * (layer_fwd + head_fwd) + 3 * adapters + recompute + (1 + 2.5 + 1) * attention_fwd
    return model, hardware, attention_fwd


def test_mfu_and_tflops_follow_the_hand_count():
    # Tiles given as counts: `auto` lets the estimate leave so small a model untiled (nothing to recompute).
    # Attention re-run in backward (`auto` keeps its output at this size: the case below).
    config = TrainConfig.from_flat({"model": "tiny-llama", "seq_len": 64, "lora_r": 8, "tiled_mlp": 2, "tiled_loss": 2,
                                    "recompute_attention": "on"})
    hardware = resolve_hardware(gpu="h100-80gb", host_mem=64 * GiB)
    est = estimate_summary(estimate(config, hardware, suggest=False), config, preset_config("tiny-llama"))
    model, hw, attention = _hand_count_with_attention(64, 8)
    assert est["model_flops"] == model and est["hardware_flops"] == hw
    # By kernel: attention's forward and checkpointing's second one, its backward (2.5 forwards), matmuls the rest.
    assert est["hardware_attention_forward_flops"] == 2 * attention
    assert est["hardware_attention_backward_flops"] == 2.5 * attention
    assert est["hardware_attention_flops"] == 4.5 * attention and est["hardware_matmul_flops"] == hw - 4.5 * attention
    record = {"outcome": "ok", "median_s": 0.002, "world_size": 1, "tokens_per_step": 64, "estimate": est,
              "peak_allocated": est["device_peak_bytes"] // 2, "peak_reserved": est["device_peak_bytes"] // 4,
              "device": "cuda:0", "hardware": hardware.to_dict()}
    figures = derive(record)
    assert figures["tokens_per_s"] == pytest.approx(64 / 0.002)
    assert figures["model_tflops"] == pytest.approx(model / 0.002 / 1e12)
    assert figures["hardware_tflops"] == pytest.approx(hw / 0.002 / 1e12)
    assert figures["mfu"] == pytest.approx(model / 0.002 / 1e12 / 989.0)  # the H100's bf16 dense peak
    assert figures["hfu"] == pytest.approx(hw / 0.002 / 1e12 / 989.0)  # recompute counted
    assert figures["estimate_peak_error_pct"] == pytest.approx(100.0, abs=0.01)  # predicted twice what was measured
    assert figures["estimate_reserved_error_pct"] == pytest.approx(300.0, abs=0.01)  # and 4 × what was reserved
    # Attention's output kept (issue 33, `auto` here): the same model FLOPs, one attention forward fewer.
    kept = TrainConfig.from_flat({"model": "tiny-llama", "seq_len": 64, "lora_r": 8, "tiled_mlp": 2, "tiled_loss": 2})
    est = estimate_summary(estimate(kept, hardware, suggest=False), kept, preset_config("tiny-llama"))
    assert est["model_flops"] == model and est["hardware_flops"] == hw - attention
    assert est["hardware_attention_forward_flops"] == attention
    assert est["hardware_attention_backward_flops"] == 2.5 * attention


def test_a_cpu_trial_gives_no_device_estimate_error():
    """On a CPU the trial's RSS is not the device the estimate models (issue 32: -68 to -70 % that meant nothing)."""
    config = TrainConfig.from_flat({"model": "tiny-llama", "seq_len": 64})
    hardware = resolve_hardware(gpu="cpu", host_mem=64 * GiB)
    est = estimate_summary(estimate(config, hardware, suggest=False), config, preset_config("tiny-llama"))
    record = {"outcome": "ok", "median_s": 0.5, "world_size": 1, "tokens_per_step": 64, "estimate": est,
              "peak_allocated": 3 * est["device_peak_bytes"], "device": "cpu", "hardware": hardware.to_dict()}
    figures = derive(record)
    assert figures["estimate_peak_error_pct"] is None and figures["estimate_reserved_error_pct"] is None
    assert figures["estimate_time_error_pct"] is not None and figures["mfu"] > 0


def test_a_step_on_several_devices_counts_each_devices_share():
    config = TrainConfig.from_flat({"model": "tiny-llama", "seq_len": 64, "grad_accum": 2})
    hardware = resolve_hardware(gpu="h100-80gb", host_mem=64 * GiB, gpus=2)
    prediction = estimate(config, hardware, suggest=False)
    est = estimate_summary(prediction, config, preset_config("tiny-llama"))
    one = estimate(TrainConfig.from_flat({"model": "tiny-llama", "seq_len": 64}),
                   resolve_hardware(gpu="h100-80gb", host_mem=64 * GiB), suggest=False).flops.model  # one sample's
    # Each of the 2 ranks reads 2 samples a step (grad-accum 2), whatever the SP degree: 4 samples' FLOPs.
    assert est["model_flops"] == 4 * one
    record = {"outcome": "ok", "median_s": 1.0, "world_size": 2, "tokens_per_step": 4 * 64, "estimate": est}
    assert derive(record)["model_tflops"] == pytest.approx(2 * one / 1e12)


def test_the_attention_split_counts_every_sequence_of_a_micro_batch():
    """The estimate scales a micro-batch's FLOPs by its sequences: the backward part scales with them (4 sequences
    per step here: micro-batch 2 × grad-accum 2), checkpointing off (one forward, no recompute)."""
    config = TrainConfig.from_flat({"model": "tiny-llama", "seq_len": 64, "micro_batch_size": 2, "grad_accum": 2,
                                    "checkpointing": False})
    hardware = resolve_hardware(gpu="h100-80gb", host_mem=64 * GiB)
    est = estimate_summary(estimate(config, hardware, suggest=False), config, preset_config("tiny-llama"))
    attention = 4 * 4 * 32 * 4 * (64 * 65 // 2)  # layers × 4·head_dim·heads × causal pairs
    assert est["hardware_attention_forward_flops"] == 4 * attention
    assert est["hardware_attention_backward_flops"] == 4 * 2.5 * attention


def test_failed_trials_have_no_figures_and_errors_need_a_measurement():
    assert derive({"outcome": "oom"}) == {}
    assert percent_error(10, None) is None and percent_error(None, 5) is None
    assert percent_error(90, 100) == pytest.approx(-10.0)


def test_a_ladder_rungs_estimate_is_of_alst_tiles_as_it_runs_them():
    """A ladder rung runs `auto` tiles unresolved (ALST's MLP tiles of `hidden` tokens; on CUDA Liger's loss); its
    estimate must be of those, not of the fewest tiles the estimate would choose for train."""
    seq = 64 * 1024
    rung = TrainConfig.from_flat({"model": "llama-3.1-8b", "seq_len": seq, "lora_r": 16, "tiled_mlp": "auto",
                                  "tiled_loss": "auto", "offload_checkpoints": False, "attn_chunks": "off"})
    hardware = resolve_hardware(gpu="h100-80gb", host_mem=128 * GiB)
    resolved = estimate(rung, hardware, suggest=False)
    as_run = estimate(rung, hardware, suggest=False, resolve_auto=False)
    assert resolved.memory_choice.tiled_mlp != "auto" and as_run.memory_choice is None
    alst = TrainConfig.from_flat({**rung.to_dict(), "tiled_mlp": seq // 4096})
    pinned = estimate(alst, hardware, suggest=False, resolve_auto=False)
    assert as_run.device_peak_bytes == pinned.device_peak_bytes != resolved.device_peak_bytes
