"""`lstune estimate` end to end: the table, the verdict, the longest sequence, --json, recipes, and every bad
input's one-line message with exit code 2."""

from __future__ import annotations

import json
import re

import pytest

from tests.integration.conftest import light_help

H100 = ["--gpu", "h100-80gb", "--host-mem", "128G"]


def test_table_verdict_and_longest_sequence(cli):
    result = cli("estimate", "--model", "llama-3.1-8b", "--seq-len", "64k", "--lora-r", "16", *H100)
    assert result.code == 0, result.err
    for text in ("frozen parameters", "activation checkpoints", "layer backward: attention block", "verdict: fits",
                 "longest sequence that fits", "tokens/s", "residual stream bf16"):
        assert text in result.out, text


def test_json_has_the_contract_fields(cli):
    result = cli("estimate", "--model", "llama-3.1-8b", "--seq-len", "1M", "--lora-r", "16", "--json", *H100)
    assert result.code == 0, result.err
    data = json.loads(result.out)
    assert data["fits"] is False and data["longest_seq_len"] < 2**20
    assert data["suggestions"] and data["flops"]["model"] > 0 and data["step_seconds"] > 0
    assert data["dtypes"]["frozen"] == data["dtypes"]["residual"] == data["dtypes"]["act"] == 2
    assert data["checkpoint_bytes_per_token_layer"] == 2 * 4096


def test_a_recipe_works_and_flags_override_it(cli):
    result = cli("estimate", "--config", "recipes/llama-3.1-8b/500k-1xh100.yaml", "--model", "llama-3.1-8b",
                 "--seq-len", "256k", "--json", *H100)
    assert result.code == 0, result.err
    data = json.loads(result.out)
    assert data["seq_len"] == 256 * 1024 and data["parameters"]["adapters"] > 0


def test_many_gpus_and_nodes(cli):
    result = cli("estimate", "--model", "llama-3.1-70b", "--seq-len", "1M", "--lora-r", "16", "--gpus", "8",
                 "--nodes", "4", "--offload-checkpoints", "--gpu", "h100-80gb", "--host-mem", "2T", "--json")
    assert result.code == 0, result.err
    data = json.loads(result.out)
    assert data["hardware"]["world_size"] == 32 and data["sp"] == 32 and data["dp"] == 1  # --sp auto: every rank
    assert data["engine"]["zero_stage"] == 3


def _assert_user_error(result, *fragments):
    assert result.code == 2, (result.code, result.out, result.err)
    assert "Traceback" not in result.err
    for fragment in fragments:
        assert fragment in result.err, (fragment, result.err)


@pytest.mark.parametrize("args, fragments", [
    (["--gpu", "h1000"], ["--gpu 'h1000' is not a known GPU", "h100-80gb", "--device-mem"]),
    (["--device-mem", "80X"], ["--device-mem '80X' is not a size"]),
    (["--device-mem", "512M"], ["--device-mem", "less than 1 GiB"]),
    (["--host-mem", "lots"], ["--host-mem 'lots' is not a size"]),
    (["--host-mem", "0"], ["--host-mem 0 bytes is less than 1 GiB"]),
    (["--host-mem", "1"], ["--host-mem 1 bytes is less than 1 GiB"]),
    (["--nodes", "0"], ["--nodes '0'"]),
    (["--seq-len", "500q"], ["--seq-len '500q' is not a length"]),
    (["--gpus", "4", "--sp", "3"], ["--sp 3"]),
    (["--model", "no/such-model-here", "--init", "bogus"], ["--init"]),
    (["--model", "./missing-folder/x/y"], ["--model"]),
])
def test_bad_input_is_one_message_with_exit_2(cli, args, fragments):
    _assert_user_error(cli("estimate", "--gpu", "h100-80gb", *args), *fragments)


def test_help_stays_light():
    shown = light_help("estimate")
    for flag in ("--gpu", "--device-mem", "--host-mem", "--nodes", "--trace", "--json", "--seq-len", "--lora-r"):
        assert flag in shown, flag
    # The hardware flags' defaults had been taken for rich markup ("... l40s or cpu .", "e.g. 512G .").
    text = " ".join(re.sub(r"[│╭╮╰╯─]", " ", shown).split())
    for shown_default in ("or cpu [default: this machine's CUDA device, else cpu].",
                          "e.g. 512G [default: with --gpu or --device-mem, the host of that GPU's class",
                          "--gpus devices [default: 1]."):
        assert shown_default in text, shown_default


@pytest.mark.parametrize("args", [
    ["--gpu", "cpu", "--host-mem", "16G", "--seq-len", "1M", "--checkpointing", "off", "--tiled-mlp", "off"],
    [*H100, "--model", "llama-3.1-8b", "--lora-r", "16", "--seq-len", "128k", "--checkpointing", "off"],
    [*H100, "--model", "llama-3.1-8b", "--lora-r", "16", "--seq-len", "400k", "--tiled-mlp", "off"],
    [*H100, "--model", "llama-3.1-8b", "--lora-r", "16", "--seq-len", "2M", "--sp", "1"],
])
def test_each_suggestion_applied_to_the_command_is_what_it_said(cli, args):
    """Each change's flags, added to the user's command, give its peaks, step time and verdict. They had left out
    part of the change (--checkpointing on, --tiled-mlp auto, --sp auto), and on a CPU --gpus N kept the one
    process's share of the RAM as each process's."""
    data = json.loads(cli("estimate", *args, "--json").out)
    assert not data["fits"] and data["suggestions"], data["suggestions"]
    for s in data["suggestions"]:
        result = cli("estimate", *args, *s["flags"].split(), "--json")
        assert result.code == 0, (s["flags"], result.err)
        applied = json.loads(result.out)
        said = (s["fits"], s["device_peak_bytes"], s["host_peak_bytes"], s["step_seconds"])
        assert (applied["fits"], applied["device_peak_bytes"], applied["host_peak_bytes"],
                applied["step_seconds"]) == said, s["flags"]


def test_trace_reports_the_measured_step_beside_the_analytic_one(cli):
    result = cli("estimate", "--model", "tiny-llama", "--seq-len", "2k", "--lora-r", "8", "--trace", "--json", *H100)
    assert result.code == 0, result.err
    trace = json.loads(result.out)["trace"]
    assert trace["checkpoint_bytes_per_token_layer"] == 2 * 128 and trace["residual_dtype"] == "bfloat16"
    assert trace["device_peak_bytes"] > 0 and abs(trace["analytic_minus_trace_fraction"]) < 0.10


def test_trace_of_a_softcapped_model_runs_on_cpu(cli):
    """Gemma-2's softcapped logits could not run on CPU until lstune's block kernel took them (issue 34)."""
    result = cli("estimate", "--model", "gemma-2-9b", "--seq-len", "1k", "--trace", *H100)
    assert result.code == 0, result.err
    assert "trace (fake tensors" in " ".join(result.out.split())
    assert "without --trace gives the run's own" in " ".join(result.out.split())


def test_trace_of_a_model_that_cannot_run_on_cpu_says_so(monkeypatch):
    """A model lstune cannot prepare on this CPU: a ConfigError (exit 2) naming --trace and the way out."""
    import lstune.train.trace as trace
    from lstune.config.schema import TrainConfig
    from lstune.errors import ConfigError, ModelError
    from lstune.estimate.hardware import resolve_hardware

    def refuse(*args, **kwargs):
        raise ModelError("this model's attention cannot run here.")

    monkeypatch.setattr(trace, "trace_step", refuse)
    config = TrainConfig.from_flat({"model": "tiny-llama", "seq_len": 1024})
    with pytest.raises(ConfigError) as caught:
        trace.trace_estimate(config, resolve_hardware(gpu="h100-80gb", host_mem=128 * 2**30))
    text = " ".join(caught.value.problems)
    assert "--trace runs the step on this CPU" in text and "cannot run here" in text and "Drop --trace" in text


def test_trace_that_fake_tensors_cannot_run_is_a_config_error(monkeypatch):
    """A kernel that fails on fake tensors (as torch's bf16-only meta `_grouped_mm` did for fp32 experts) is a
    ConfigError (exit 2) with the way out, not a traceback."""
    import lstune.train.trace as trace
    from lstune.config.schema import TrainConfig
    from lstune.errors import ConfigError
    from lstune.estimate.hardware import resolve_hardware

    def fail(*args, **kwargs):
        raise RuntimeError("Expected inputs of BF16 type\nmore")

    monkeypatch.setattr(trace, "trace_step", fail)
    config = TrainConfig.from_flat({"model": "tiny-llama", "seq_len": 1024})
    with pytest.raises(ConfigError) as caught:
        trace.trace_estimate(config, resolve_hardware(gpu="h100-80gb", host_mem=128 * 2**30))
    text = " ".join(caught.value.problems)
    assert "Expected inputs of BF16 type" in text and "more" not in text and "Drop --trace" in text


def test_trace_of_a_full_fine_tune_of_an_moe_runs(cli):
    """fp32 experts (no LoRA) traced through transformers' grouped-matmul fallback (hf_internals)."""
    result = cli("estimate", "--model", "tiny-qwen3-moe", "--seq-len", "512", "--trace", *H100)
    assert result.code == 0, result.err
    assert "trace (fake tensors" in " ".join(result.out.split())


def test_train_prints_the_predicted_peak_before_loading_weights(cli, tmp_path, text_data):
    from tests.integration.conftest import TINY_MODEL

    result = cli("train", *TINY_MODEL, "--data", text_data, "--max-steps", "1", "--output-dir", tmp_path / "run")
    assert result.code == 0, result.err
    assert result.out.index("estimate:") < result.out.index("engine:")
    note = " ".join(result.out[result.out.index("estimate:"):result.out.index("engine:")].split())  # unwrapped
    # A tiny model's peak in MiB, not "0.0 GiB".
    assert re.search(r"predicted peak \d+\.\d MiB of \d+\.\d GiB per device", note) and "fits" in note, note


def test_the_checkpoint_placement_is_predicted_and_shown(cli):
    """A host budget of 10 checkpoints and a device budget of 8 leave some of Llama-8B's 32 layers recomputed."""
    one = 65536 * 4096 * 2  # one bf16 checkpoint of 64K tokens: 512 MiB
    args = ("estimate", "--model", "llama-3.1-8b", "--seq-len", "64k", "--lora-r", "16", *H100,
            "--offload-checkpoints", "--host-mem-budget", str(10 * one), "--checkpoint-device-budget", str(8 * one))
    data = json.loads(cli(*args, "--json").out)
    placed = data["checkpoint_placement"]
    assert placed["recomputed_layers"] and placed["host_bytes"] <= 10 * one
    assert placed["device_bytes"] + (1 + 2) * one <= 8 * one  # device parts + fetched back + longest segment
    assert 0 < placed["extra_recompute_pct"] < 100
    checkpoints = next(i for i in data["breakdown"] if i["name"] == "activation checkpoints")
    assert checkpoints["host_bytes"] == placed["host_bytes"] and "recompute" in checkpoints["detail"]
    plain = json.loads(cli(*args[:-4], "--json").out)
    assert data["flops"]["hardware"] > plain["flops"]["hardware"]
    table = cli(*args)
    assert table.code == 0 and "recompute" in table.out


def test_a_bad_checkpoint_device_budget_exits_2(cli):
    result = cli("estimate", "--model", "llama-3.1-8b", "--seq-len", "64k", *H100, "--checkpoint-device-budget", "-5")
    _assert_user_error(result, "--checkpoint-device-budget")
