"""Which engine trains the model and whether the run may start: the estimate's answer for this machine
(lstune.train.engine_choice), on every branch, with no GPU needed (the cluster is given)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from lstune.config.schema import TrainConfig
from lstune.errors import ConfigError
from lstune.estimate.hardware import resolve_hardware
from lstune.models.presets import preset_config
from lstune.train.engine_choice import check_fits, plan_run, zero_plan

GiB = 1024**3


def _plan(model="tiny-llama", gpu="cpu", gpus=1, host=64 * GiB, **flat):
    config = TrainConfig.from_flat({"model": model, **flat})
    cluster = resolve_hardware(gpu=gpu, gpus=gpus, host_mem=host)
    runtime = SimpleNamespace(device=torch.device("cuda" if gpu != "cpu" else "cpu"))
    prediction = plan_run(config, runtime, preset_config(model), cluster=cluster)
    return config, prediction, runtime


def test_one_cpu_process_trains_with_plain_adamw():
    _, prediction, _ = _plan()
    assert zero_plan(prediction) is None and prediction.fits


def test_lora_of_8b_on_one_h100_keeps_plain_adamw():
    _, prediction, _ = _plan("llama-3.1-8b", gpu="h100-80gb", lora_r=16, seq_len=32768)
    assert zero_plan(prediction) is None


def test_full_fine_tune_of_8b_on_one_h100_puts_adam_on_the_host():
    """144 GB of weights + gradients + Adam state: ALST's single-GPU setup."""
    _, prediction, _ = _plan("llama-3.1-8b", gpu="h100-80gb", host=512 * GiB, seq_len=16384)
    plan = zero_plan(prediction)
    assert (plan.stage, plan.offload_optimizer) == (3, True)
    assert "predicted peak" in plan.reason


def test_full_fine_tune_of_8b_on_one_h100_with_128_gib_of_host_keeps_half_the_optimizer_on_the_gpu():
    """Everything on the host needs 171.9 GiB (fp32 master + Adam 89.7, fp32 gradients 64.1 pinned, bf16 weights
    16): `--zero-stage auto` goes on to part of the optimizer on the GPU and takes the first that fits, 1/2 (3/4 on
    the host still needs 142 GiB): 17 of DeepSpeed's 34 optimizer sub-groups on the GPU — at 16K, within the margin a
    fit keeps (issue 32: 8 % of the device, 4 % of the host), with checkpoints offloaded: device 68.8 GiB, host
    116.7 GiB — up to 44K with the memory techniques (before the margin: no offload, device 72.3 GiB, host 112.9 GiB,
    up to 114K). With the whole-offload engine asked for, the refusal names it."""
    config, prediction, runtime = _plan("llama-3.1-8b", gpu="h100-80gb", host=128 * GiB, seq_len=16384,
                                        zero_stage="3", offload_optimizer=True, offload_params=True)
    assert not prediction.fits
    with pytest.raises(ConfigError, match="--offload-ratio 0.5"):
        check_fits(config, prediction, runtime)
    # The peaks below are with attention re-run in backward (`auto` would keep its output here, offloading the
    # checkpoints to make room: issue 33).
    _, prediction, _ = _plan("llama-3.1-8b", gpu="h100-80gb", host=128 * GiB, seq_len=16384, recompute_attention="on")
    assert prediction.fits and prediction.longest_seq_len >= 44 * 1024
    assert prediction.device_peak_bytes / GiB == pytest.approx(68.8, abs=0.1)
    assert prediction.host_peak_bytes / GiB == pytest.approx(116.7, abs=0.1)
    plan = zero_plan(prediction)
    assert (plan.stage, plan.offload_optimizer, plan.offload_params, plan.offload_ratio) == (3, True, True, 0.5)
    assert "optimizer (50% of it)" in plan.reason
    parts = {item.name: item for item in prediction.breakdown.items}
    # 17 of 34 sub-groups on the device: the embedding (525,336,576 parameters, one of its own) and 16 of one decoder
    # layer's weights each (DeepSpeed closes a sub-group at the tensor reaching 209,715,200, the down projection:
    # 218,103,808 parameters, then the layer's two norms run into the next); their fp32 master, m, v (+ AdamW's two
    # temporaries of the largest) and fp32 gradient.
    on_device = 525_336_576 + 218_103_808 + 15 * 218_112_000
    assert "17 of 34 sub-groups on the device" in parts["gradients"].detail
    assert parts["optimizer state"].device == on_device * 12 + 2 * 4 * 525_336_576
    assert parts["gradients"].device == on_device * 4


def test_a_narrow_partial_offload_window_is_found_at_the_sub_groups_resolution():
    """Llama-3.1-8B's full fine-tune at 16K on an H100 with 120 GiB of host, within the margin a fit keeps (issue
    32; before it the window was at 112 GiB, 13/32 and 14/32, and 112 GiB now fits nothing): 3/4 and 1/2 of the
    optimizer on the host are over the host, 1/4 over the device; 15/32 fits. `auto` takes it and says how far it
    reaches; with the whole offload asked for, the refusal names that ratio."""
    from lstune.estimate import partial_offload_ratios

    ratios = partial_offload_ratios()
    assert ratios[:3] == [0.75, 0.5, 0.25] and len(ratios) == len(set(ratios)) == 31
    assert sorted(ratios) == [k / 32 for k in range(1, 32)]
    config, prediction, runtime = _plan("llama-3.1-8b", gpu="h100-80gb", host=120 * GiB, seq_len=16384)
    assert prediction.fits, prediction.verdict()
    plan = zero_plan(prediction)
    assert (plan.stage, plan.offload_optimizer, plan.offload_params, plan.offload_ratio) == (3, True, True, 15 / 32)
    assert prediction.device_peak_bytes / GiB == pytest.approx(70.8, abs=0.1)
    assert prediction.host_peak_bytes / GiB == pytest.approx(110.2, abs=0.1)
    assert not _plan("llama-3.1-8b", gpu="h100-80gb", host=112 * GiB, seq_len=16384)[1].fits
    assert prediction.longest_seq_len >= 16384  # the ratio picked here is among those the longest is searched over
    config, prediction, runtime = _plan("llama-3.1-8b", gpu="h100-80gb", host=120 * GiB, seq_len=16384,
                                        zero_stage="3", offload_optimizer=True, offload_params=True)
    with pytest.raises(ConfigError, match="--offload-ratio 0.46875"):
        check_fits(config, prediction, runtime)



def test_70b_lora_on_8_gpus_is_sharded_not_zero1():
    """The old rule counted trainable weights only and chose ZeRO-1 with '1.5 GB per device': the bf16 base
    alone is 141 GB on every GPU."""
    _, prediction, _ = _plan("llama-3.1-70b", gpu="h100-80gb", gpus=8, host=1024 * GiB, lora_r=16, seq_len=32768)
    assert zero_plan(prediction).stage == 3 and prediction.fits


def test_several_cpu_processes_use_zero1():
    _, prediction, _ = _plan(gpus=4)
    assert zero_plan(prediction).stage == 1


def test_an_explicit_stage_and_offload_are_taken_as_given():
    _, prediction, _ = _plan(zero_stage="3", offload_optimizer=True, offload_params=True)
    plan = zero_plan(prediction)
    assert (plan.stage, plan.offload_optimizer, plan.offload_params) == (3, True, True)
    _, asked, _ = _plan(offload_optimizer=True)
    assert (zero_plan(asked).stage, zero_plan(asked).offload_optimizer) == (3, True)


def test_stage_zero_with_several_processes_is_refused_with_the_config_rule():
    with pytest.raises(ConfigError, match="--zero-stage 0 is plain single-device AdamW"):
        _plan(gpus=2, zero_stage="0")


def test_a_run_that_will_not_fit_stops_with_the_changes_that_would_and_force_overrides():
    config, prediction, runtime = _plan("llama-3.1-8b", gpu="h100-80gb", host=128 * GiB, lora_r=16, seq_len=300 * 1024,
                                     offload_checkpoints=False)
    assert not prediction.fits
    with pytest.raises(ConfigError) as exc:
        check_fits(config, prediction, runtime)
    message = str(exc.value)
    assert "predicted not to fit" in message and "--offload-checkpoints" in message and "--force" in message
    assert exc.value.exit_code == 2
    forced = TrainConfig.from_flat({**config.to_dict(), "force": True})
    check_fits(forced, prediction, runtime)  # no error


def test_auto_tiling_leaves_a_tiny_model_at_4k_uncut_on_the_cpu():
    # The CPU's "device" is this machine's RAM: the untiled step of tiny-llama at 4K is far below it.
    _, prediction, _ = _plan(seq_len=4096, host=16 * GiB)
    assert (prediction.memory_choice.tiled_mlp, prediction.memory_choice.tiled_loss) == ("off", "off")


def test_auto_tiling_cuts_llama_8b_at_128k_on_an_80gb_device_and_keeps_what_is_given():
    _, prediction, _ = _plan("llama-3.1-8b", gpu="h100-80gb", lora_r=16, seq_len=131072)
    mlp = prediction.memory_choice.tiled_mlp
    assert isinstance(mlp, int) and 1 < mlp <= 131072 // 4096  # a few tiles, at most ALST's tiles of hidden size
    assert prediction.memory_choice.tiled_loss == "auto"  # Liger's chunks on CUDA
    assert prediction.fits and prediction.device_peak_bytes <= 0.9 * prediction.device_capacity
    fewer = _plan("llama-3.1-8b", gpu="h100-80gb", lora_r=16, seq_len=131072, tiled_mlp=mlp // 2)[1]
    assert fewer.device_peak_bytes > 0.9 * fewer.device_capacity or fewer.engine != prediction.engine
    given = _plan("llama-3.1-8b", gpu="h100-80gb", lora_r=16, seq_len=131072, tiled_mlp=5, tiled_loss=7)[1]
    assert (given.memory_choice.tiled_mlp, given.memory_choice.tiled_loss) == (5, 7)


def test_the_tiles_the_estimate_chose_are_what_the_model_is_prepared_with():
    from lstune.memory.apply import apply_memory_techniques
    from lstune.models.presets import build_model

    config, prediction, _ = _plan(seq_len=4096, host=16 * GiB)
    plan = apply_memory_techniques(build_model("tiny-llama"), prediction.memory_choice.applied_to(config).memory, seq_len=4096)
    assert plan.tiled_mlp == "off" and plan.loss_tiles_at_seq_len == 1
    assert plan.summary()["tiled_loss"]["backend"] == "plain"


@pytest.mark.parametrize("seq_len, host, offload", [
    (131072, 500 * GiB, False),  # fits the device with ALST's tiles: no offload
    (262144, 500 * GiB, True),  # does not without it, and the host holds 31 checkpoints
    # The host holds 7 of them (14 GiB budget): the default placement keeps 3 on the device, recomputes the rest.
    (262144, 16 * GiB, True),
])
def test_auto_checkpoint_offload_turns_on_exactly_when_the_device_needs_it_and_the_host_holds_it(seq_len, host, offload):
    # With attention re-run in backward: `auto` also offloads where that lets attention's output be kept (below).
    flat = dict(lora_r=16, seq_len=seq_len, zero_stage="0", recompute_attention="on")
    _, prediction, _ = _plan("llama-3.1-8b", gpu="h100-80gb", host=host, **flat)
    assert prediction.memory_choice.offload_checkpoints is offload
    off = _plan("llama-3.1-8b", gpu="h100-80gb", host=host, tiled_mlp="auto", offload_checkpoints=False, **flat)[1]
    on = _plan("llama-3.1-8b", gpu="h100-80gb", host=host, offload_checkpoints=True, **flat)[1]
    if offload:  # needed (the device cannot hold the run without it) and enough (with it the run fits)
        assert not off.fits_device and on.fits and prediction.fits
    else:  # not needed, or the host cannot hold the offloaded checkpoints
        assert off.fits_device or not on.fits_host


@pytest.mark.parametrize("seq_len, host, kept, offload", [
    (16384, 128 * GiB, True, False),  # the outputs fit the device beside everything else
    (131072, 500 * GiB, True, True),  # they do not: the checkpoints go to the host, the outputs with them
    (262144, 128 * GiB, False, True),  # the host cannot hold them too: attention is re-run, as before
])
def test_auto_keeps_attentions_output_where_the_bytes_fit_and_recomputes_at_the_longest(seq_len, host, kept, offload):
    """--recompute-attention auto (issue 33): attention's output kept where the run with it fits the device within
    the headroom and the host — offloading the checkpoints for it if that is what makes it fit —, re-run where not."""
    _, prediction, _ = _plan("llama-3.1-8b", gpu="h100-80gb", host=host, lora_r=16, seq_len=seq_len, zero_stage="0")
    choice = prediction.memory_choice
    assert choice.recompute_attention == ("off" if kept else "on") and choice.offload_checkpoints is offload
    assert prediction.fits and (prediction.breakdown.attention_saved_layers == 32) is kept
    recomputed = _plan("llama-3.1-8b", gpu="h100-80gb", host=host, lora_r=16, seq_len=seq_len, zero_stage="0",
                       recompute_attention="on")[1]
    if kept:  # one attention forward fewer per layer, the same model FLOPs
        assert prediction.flops.model == recomputed.flops.model
        assert prediction.flops.hardware_attention < recomputed.flops.hardware_attention
        assert prediction.step_seconds < recomputed.step_seconds


def test_auto_checkpoint_offload_stays_off_on_the_cpu_and_is_applied_as_chosen():
    from lstune.memory.apply import apply_memory_techniques
    from lstune.models.presets import build_model

    config, prediction, _ = _plan(seq_len=4096, host=16 * GiB)
    assert prediction.memory_choice.offload_checkpoints is False
    plan = apply_memory_techniques(build_model("tiny-llama"), prediction.memory_choice.applied_to(config).memory,
                                   seq_len=4096)
    assert plan.checkpointing and not plan.offload
