"""One run plan (lstune.train.plan) and one build (lstune.train.build) for train, bench and the trace: a bench trial
builds the very model `lstune train` builds from the same config; a trial's plan is for the memory the trial may
use; the plan refuses everything at once and resolves every `auto`."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from lstune.config.load import build_config
from lstune.config.schema import TrainConfig
from lstune.errors import ConfigError
from lstune.estimate.hardware import resolve_hardware
from lstune.train.plan import dtypes_of, plan, resolved_recipe

GiB = 2**30


def _captured_builds(monkeypatch) -> list:
    import lstune.train.build as build_module

    built, real = [], build_module.build

    def capture(*args, **kwargs):
        built.append(real(*args, **kwargs))
        return built[-1]

    monkeypatch.setattr(build_module, "build", capture)
    return built


def _view(built) -> dict:
    """What makes two builds the same model: module tree, parameters' dtypes and trainability, the instance patches
    installed, RoPE, the memory plan, the engine."""
    model = built.model
    return {
        "modules": [(name, type(m).__name__) for name, m in model.named_modules()],
        "parameters": [(name, p.dtype, p.requires_grad) for name, p in model.named_parameters()],
        "patched": sorted(name for name, m in model.named_modules() if "forward" in vars(m)),
        "rope": getattr(model.config, "rope_parameters", None),
        "max_positions": model.config.max_position_embeddings,
        "memory": {k: v for k, v in built.prepared.memory.summary().items() if k != "notes"},
        "engine": type(built.engine).__name__,
    }


@pytest.mark.parametrize("flags", [
    {"lora_r": "4", "rope_scaling": "linear", "rope_factor": "2", "seq_len": "384", "attn_chunks": "2"},
    {"tiled_mlp": "2", "tiled_loss": "3", "seq_len": "256"},
], ids=["lora-rope-chunks", "full-tiles"])
def test_train_and_a_bench_trial_build_the_same_model(tmp_path, monkeypatch, flags):
    from lstune.bench.trial import Job, run_step_trial
    from lstune.train.run import train

    built = _captured_builds(monkeypatch)
    flat = {"model": "tiny-llama", "data": "builtin:passkey", "max_steps": "1", "output_dir": str(tmp_path / "o"),
            **flags}
    train(build_config({}, flat))
    config = build_config({}, {**flat, "output_dir": str(tmp_path / "b")})
    record = run_step_trial(Job(1, "step", "lstune", config.to_dict(), warmup=0, steps=1))
    assert record["outcome"] == "ok", record.get("error")
    assert len(built) == 2
    train_view, bench_view = _view(built[0]), _view(built[1])
    assert train_view == bench_view
    if "rope_scaling" in flags:  # RoPE was applied to both, not left out of the trial
        assert train_view["rope"]["rope_type"] == "linear" and train_view["rope"]["factor"] == 2.0


def test_a_4bit_base_loads_its_other_parts_in_bf16_on_cuda_for_every_caller(monkeypatch):
    """The dtypes are the plan's: train and bench load through `load_weights`, which passes them on."""
    import lstune.models.loading as loading
    from lstune.train.build import load_weights

    seen = {}
    monkeypatch.setattr(loading, "load_model", lambda spec, **kwargs: seen.update(kwargs))
    config = TrainConfig.from_flat({"model": "tiny-llama", "lora_r": 8, "load_in_4bit": True, "init": "pretrained"})
    engine = SimpleNamespace(kind="torch")
    assert dtypes_of(config, "cuda", engine).quantized_rest == "bf16"
    assert dtypes_of(config, "cpu", engine).quantized_rest == "fp32"
    run_plan = SimpleNamespace(config=config, spec=None, dtypes=dtypes_of(config, "cuda", engine))
    load_weights(run_plan, SimpleNamespace(device=torch.device("cpu")))
    assert seen["param_dtype"] is torch.bfloat16 and seen["load_in_4bit"] is True


def test_random_weights_are_made_where_one_process_keeps_them_in_the_dtype_it_keeps(monkeypatch):
    """A LoRA base kept in bf16 on CUDA loads in bf16 (not fp32, cast later), and its random weights are made on the
    device when one process keeps them all there; under DeepSpeed, several processes or a CPU run they are made on
    the CPU, in the dtype as before (2026-11-28-h100: 8.0 B random weights took ~120 s on the CPU)."""
    import lstune.models.loading as loading
    from lstune.train.build import load_weights

    seen = {}
    monkeypatch.setattr(loading, "load_model", lambda spec, **kwargs: seen.update(kwargs))
    cuda = torch.device("cuda", 0)

    def load(flat, device, engine="torch", world=1):
        config = TrainConfig.from_flat({"model": "tiny-llama", **flat})
        engine = SimpleNamespace(kind=engine)
        run_plan = SimpleNamespace(config=config, spec=None, dtypes=dtypes_of(config, device.type, engine),
                                   engine=engine)
        load_weights(run_plan, SimpleNamespace(device=device, world_size=world))
        return seen["param_dtype"], seen["init_device"]

    assert load({"lora_r": 8}, cuda) == (torch.bfloat16, cuda)
    assert load({"lora_r": 8}, cuda, engine="deepspeed") == (torch.bfloat16, None)
    assert load({"lora_r": 8}, cuda, world=2) == (torch.bfloat16, None)
    assert load({"lora_r": 0}, cuda) == (None, cuda)  # a full fine-tune keeps fp32 weights on one device
    assert load({"lora_r": 8}, torch.device("cpu")) == (None, None)


def test_load_model_makes_random_weights_on_the_device_it_is_given():
    from lstune.models.loading import load_model

    model = load_model("tiny-llama", init="random", init_device="meta").model
    assert {p.device.type for p in model.parameters()} == {"meta"}
    assert {p.device.type for p in load_model("tiny-llama", init="random").model.parameters()} == {"cpu"}


def test_a_bench_trials_plan_is_for_the_host_memory_the_trial_may_use():
    from lstune.bench.trial import Job, run_step_trial

    config = TrainConfig.from_flat({"model": "tiny-llama", "seq_len": 128})
    record = run_step_trial(Job(1, "step", "lstune", config.to_dict(), warmup=0, steps=1, host_cap=3 * GiB))
    assert record["outcome"] == "ok", record.get("error")
    assert record["hardware"]["host_bytes"] == 3 * GiB
    assert record["estimate"]["device_capacity"] == 3 * GiB  # on CPU the "device" is that RAM


def test_auto_sizes_for_a_capped_host_and_not_for_the_machine(monkeypatch):
    """The bench's failure: `auto` sized for 23.5 GiB while the trial might use 3 GiB. With a 50K vocabulary at 16K
    tokens the full fp32 logits alone take 3 GiB: uncapped, `auto` leaves the loss untiled; capped at 3 GiB it tiles
    it and the step's peak fits the cap (on CPU the "device" is that RAM)."""
    import lstune.estimate.hardware as hardware
    from lstune.models.presets import preset_config
    from lstune.models.loading import ModelSpec, resolve_source
    from lstune.train.plan import machine_cluster

    monkeypatch.setattr(hardware, "local_host_bytes", lambda: 64 * GiB)
    model_config = preset_config("tiny-llama", vocab_size=50_000, hidden_size=256, num_hidden_layers=2)
    config = TrainConfig.from_flat({"model": "tiny-llama", "seq_len": 16384})

    def planned(cap):
        spec = ModelSpec(resolve_source("tiny-llama"), model_config)
        return plan(config, machine_cluster("cpu", host_cap=cap), "cpu", spec=spec)

    free, capped = planned(None), planned(3 * GiB)
    assert free.memory.tiled_loss == "off" and free.fits
    assert capped.memory.tiled_loss not in ("off", "auto") and capped.estimate.fits_device
    assert capped.estimate.device_peak_bytes <= 3 * GiB < free.estimate.device_peak_bytes


def test_every_refusal_is_reported_at_once():
    config = TrainConfig.from_flat({"model": "tiny-llama", "gpus": 2, "sp": 3, "lora_r": 16, "load_in_4bit": True,
                                    "rope_scaling": "yarn", "rope_factor": 4, "seq_len": 4096})
    with pytest.raises(ConfigError) as exc:
        plan(config, resolve_hardware(gpu="cpu", gpus=2, host_mem=16 * GiB), "cpu")
    text = "\n".join(exc.value.problems)
    assert "--sp 3 does not fit 2 process(es)" in text and "--load-in-4bit" in text


def test_the_plan_leaves_no_auto_it_resolves():
    run_plan = plan(TrainConfig.from_flat({"model": "tiny-llama", "seq_len": 8192}),
                    resolve_hardware(gpu="h100-80gb", host_mem=256 * GiB), "cuda")
    recipe = resolved_recipe(run_plan)
    for key in ("sp", "zero_stage", "dtype", "attn", "init", "tiled_mlp", "offload_checkpoints", "mini_sequence",
                "attn_chunks"):
        assert recipe[key] != "auto", key
    assert recipe["dtype"] == "bf16" and recipe["zero_stage"] == "0" and recipe["init"] == "random"
    assert run_plan.resolved.memory == run_plan.estimate.memory_choice.memory  # one memory-settings type


def test_a_metp_plan_runs_no_mlp_tiles_where_auto_would_tile():
    """--metp-mlp runs each MLP on (s/SP)×(I/SP) itself: the plan resolves the MLP tiles and mini-sequence off (what
    train prepares), even at a length where `auto` alone tiles the MLP."""
    cluster = resolve_hardware(gpu="h100-80gb", gpus=2, host_mem=256 * GiB)
    flags = {"model": "llama-3.1-8b", "seq_len": 1024 * 1024, "gpus": 2, "sp": 2}
    tiled = resolved_recipe(plan(TrainConfig.from_flat(flags), cluster, "cuda"))
    metp = resolved_recipe(plan(TrainConfig.from_flat({**flags, "metp_mlp": True}), cluster, "cuda"))
    assert tiled["tiled_mlp"] not in ("off", "auto") or tiled["mini_sequence"] is True, tiled
    assert (metp["tiled_mlp"], metp["mini_sequence"], metp["metp_mlp"]) == ("off", False, True), metp


def test_under_a_host_cap_the_defaults_rung_reaches_at_least_as_far_as_every_ladder_rung(monkeypatch):
    """The bench's failure: under `--max-host-mem 3G` the `lstune` rung (lstune's defaults) reached 2K while the
    mini-sequence rung reached 32K, because `auto` sized for the machine's RAM. Each rung's configuration, planned
    for the cap a trial has, must now reach (predicted longest length) no less far with the defaults. (6 GiB, not
    3: the host keeps its OS reserve of 4 GiB + 1 % beside the cap's bytes, so 3 GiB fits no step at all.)"""
    import lstune.estimate.hardware as hardware
    from lstune.bench.rungs import LADDER, RUNGS, rung_config
    from lstune.estimate.prediction import predict
    from lstune.models.presets import preset_config
    from lstune.train.plan import machine_cluster

    monkeypatch.setattr(hardware, "local_host_bytes", lambda: 24 * GiB)
    model_config = preset_config("tiny-llama", vocab_size=50_000, hidden_size=256, num_hidden_layers=2)
    given = TrainConfig.from_flat({"model": "tiny-llama", "seq_len": 2048})
    cluster = machine_cluster("cpu", host_cap=6 * GiB)
    reach = {name: predict(rung_config(given, RUNGS[name], in_ladder=True), cluster, model_config=model_config,
                           resolve_auto=name == "lstune").longest_seq_len
             for name in (*LADDER, "lstune")}
    assert reach["mini_seq"] > reach["hf"]  # the cap binds: the techniques matter here
    assert all(reach["lstune"] >= longest for longest in reach.values()), reach


def test_the_resolved_recipe_names_the_rope_factor_and_lora_modules_it_uses():
    """--dry-run's recipe leaves no `auto` in the model section: the RoPE factor written into the model's config,
    peft's own choice of modules for --lora-targets auto, and no LoRA/RoPE keys that do nothing in the run."""
    cluster = resolve_hardware(gpu="h100-80gb", host_mem=256 * GiB)
    lora = resolved_recipe(plan(TrainConfig.from_flat({"model": "tiny-llama", "seq_len": 16384, "lora_r": 8,
                                                        "rope_scaling": "yarn",
                                                        "original_max_position_embeddings": 2048}), cluster, "cuda"))
    assert lora["lora_targets"] == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
    assert lora["rope_factor"] == 16384 / 2048
    full = resolved_recipe(plan(TrainConfig.from_flat({"model": "tiny-llama", "seq_len": 8192}), cluster, "cuda"))
    assert "lora_targets" not in full and "rope_factor" not in full
