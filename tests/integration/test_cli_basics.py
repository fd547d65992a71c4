"""The CLI's surface: help, startup cost, dry runs, and every bad input's promised message and exit code."""

from __future__ import annotations

import json

import pytest

from tests.integration.conftest import REPO, TINY, TINY_MODEL, light_help, run_subprocess


def test_help_lists_commands_and_flags(cli):
    result = cli("--help")
    assert result.code == 0
    assert "train" in result.out and "presets" in result.out
    result = cli("train", "--help")
    assert result.code == 0
    for flag in ("--seq-len", "--data", "--pack", "--max-steps", "--lr", "--micro-batch-size", "--grad-accum",
                 "--save-every", "--keep-last", "--seed", "--overwrite", "--resume", "--lora-r", "--dry-run"):
        assert flag in result.out, flag


def test_python_dash_m_and_help_stay_light():
    """`python -m lstune train --help` works and imports no torch/transformers/deepspeed (so it answers fast)."""
    assert "--seq-len" in light_help("train")


def test_presets_command_lists_real_and_tiny_models(cli):
    result = cli("presets")
    assert result.code == 0
    for name in ("tiny-llama", "llama-3.1-8b", "llama-3.1-70b", "qwen3-32b", "gemma-2-9b", "mixtral-8x7b"):
        assert name in result.out


def test_dry_run_prints_resolved_config(cli, tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("seq_len: 8k\nlr: 1.0e-4\ndata: builtin:passkey\n")
    result = cli("train", "--config", recipe, "--lr", "5e-4", "--dry-run")
    assert result.code == 0, result.err
    assert "seq_len: 8192" in result.out
    assert "lr: 0.0005" in result.out
    assert not (tmp_path / "runs").exists()


def test_dry_run_prints_the_resolved_plan_and_the_verdict(cli):
    """--dry-run shows what the run will do, before any weights load: every `auto` the plan resolves (memory, SP,
    engine, dtype, attention, init), the layout and engine, and the estimate's verdict."""
    import yaml

    result = cli("train", *TINY, "--seq-len", "4k", "--dry-run")
    assert result.code == 0, result.err
    recipe_text, plan_text = result.out.split("# plan on", 1)
    recipe = yaml.safe_load(recipe_text)
    for key in ("tiled_mlp", "tiled_loss", "mini_sequence", "offload_checkpoints", "attn_chunks", "sp", "zero_stage",
                "dtype", "attn", "init"):
        assert recipe[key] != "auto", (key, recipe[key])
    assert "layout: 1 process(es), SP 1" in plan_text and "engine: AdamW on one device" in plan_text
    assert "estimate (predicted): device" in plan_text and "fits:" in plan_text


@pytest.mark.parametrize("args, fragments", [
    (["--gpus", "2", "--sp", "3"], ["--sp 3 does not fit 2 process(es)", "use one of 1, 2"]),
    (["--lora-r", "16", "--load-in-4bit"], ["--load-in-4bit", "initialised at random", "drop --load-in-4bit"]),
])
def test_dry_run_refuses_what_the_run_refuses_before_loading(cli, tmp_path, args, fragments):
    """--dry-run's verdict is the run's: the checks the run makes from the config and the model's config alone."""
    out = tmp_path / "o"
    dry = cli("train", *TINY, "--output-dir", out, *args, "--dry-run")
    _assert_user_error(dry, *fragments)
    assert not out.exists()


def test_data_is_required_outside_the_demo_recipe(cli, tmp_path):
    """Forgetting --data must not train on the bundled synthetic task without a word."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model: tiny-llama\nseq_len: 8k\n")
    for args in (("--config", recipe), ("--model", "tiny-llama")):
        result = cli("train", *args, "--output-dir", tmp_path / "o")
        _assert_user_error(result, "--data is required", "builtin:passkey")
        assert not (tmp_path / "o").exists()
    demo = cli("train", "--config", REPO / "recipes/tiny-llama/4k-cpu-demo.yaml", "--dry-run")
    assert demo.code == 0 and "data: builtin:passkey" in demo.out


def _assert_user_error(result, *fragments):
    assert result.code == 2, (result.code, result.out, result.err)
    assert "Traceback" not in result.err
    for fragment in fragments:
        assert fragment in result.err, (fragment, result.err)


def test_bad_length_is_one_line(cli):
    _assert_user_error(cli("train", "--seq-len", "500q"), "--seq-len '500q' is not a length; use e.g. 32768, 32k")


def test_several_config_errors_at_once(cli, tmp_path):
    result = cli("train", "--seq-len", "500q", "--lr", "fast", "--data", tmp_path / "nope.jsonl", "--model", "./nowhere")
    _assert_user_error(result, "4 problems", "--seq-len", "--lr 'fast' is not a number", "nope.jsonl", "./nowhere")


def test_missing_data(cli, tmp_path):
    _assert_user_error(cli("train", "--data", tmp_path / "missing.jsonl"), "missing.jsonl", "does not exist")


def test_empty_data(cli, tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    result = cli("train", *TINY_MODEL, "--data", empty, "--output-dir", tmp_path / "out")
    assert result.code == 2 and "Traceback" not in result.err
    assert "empty" in result.err.lower() or "no records" in result.err.lower(), result.err


def test_records_without_known_fields(cli, tmp_path):
    data = tmp_path / "odd.jsonl"
    data.write_text(json.dumps({"body": "hello"}) + "\n")
    result = cli("train", *TINY_MODEL, "--data", data, "--output-dir", tmp_path / "out")
    _assert_user_error(result, "body")
    assert "text" in result.err and "messages" in result.err and "input_ids" in result.err


def test_unknown_model(cli, tmp_path):
    _assert_user_error(cli("train", "--model", "./no/such/folder", "--dry-run"), "./no/such/folder", "preset")
    result = cli("train", "--model", "nobody-here/not-a-model-xyz", "--output-dir", tmp_path / "o", *TINY[2:])
    _assert_user_error(result, "nobody-here/not-a-model-xyz", "offline")


def test_model_folder_without_config(cli, tmp_path):
    (tmp_path / "m").mkdir()
    _assert_user_error(cli("train", "--model", tmp_path / "m", "--dry-run"), "config.json")


def test_existing_output_dir_is_not_overwritten(cli, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "precious.txt").write_text("keep me")
    _assert_user_error(cli("train", "--output-dir", out, "--dry-run"), "already exists", "--overwrite", "--resume")
    assert (out / "precious.txt").read_text() == "keep me"


def test_output_dir_not_writable(cli, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    result = cli("train", *TINY, "--max-steps", "1", "--output-dir", blocker / "out")
    _assert_user_error(result, "not writable")


def test_resume_without_checkpoint(cli, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    _assert_user_error(cli("train", *TINY, "--output-dir", out, "--resume"), "checkpoint")
    _assert_user_error(cli("train", *TINY, "--resume", tmp_path / "nothing-here"), "nothing-here")


def test_debug_shows_the_traceback():
    for args in (("--debug", "train", "--model", "./no/such", "--dry-run"), ("train", "--model", "./no/such", "--debug")):
        proc = run_subprocess(*args, timeout=60)
        assert proc.returncode == 2
        assert "Traceback" in proc.stderr and "./no/such" in proc.stderr


def test_pretokenized_ids_beyond_the_vocabulary(cli, tmp_path):
    data = tmp_path / "ids.jsonl"
    data.write_text(json.dumps({"input_ids": [5, 6, 1000, 7]}) + "\n")
    result = cli("train", *TINY_MODEL, "--data", data, "--output-dir", tmp_path / "out")
    _assert_user_error(result, "token id 1000", "vocabulary of 320")


def test_plot_command(cli, tmp_path):
    result = cli("plot", tmp_path)
    _assert_user_error(result, "no metrics.jsonl", "--output-dir")
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 2.0, "tokens_seen": 8, "tokens_per_s": 1.0,
                                                        "peak_device_mem_bytes": 1, "host_rss_bytes": 1}) + "\n")
    result = cli("plot", tmp_path)
    assert result.code == 0 and (tmp_path / "metrics.png").is_file(), result.err


def test_data_preview_shows_counts_and_the_loss_mask(cli, tmp_path):
    chat = tmp_path / "chat.jsonl"
    row = {"messages": [{"role": "user", "content": "What is the passkey?"}, {"role": "assistant", "content": "It is 4821."}]}
    chat.write_text((json.dumps(row) + "\n") * 3)
    result = cli("data", "--model", "tiny-llama", "--seq-len", "256", "--data", chat)
    assert result.code == 0, result.err
    assert "records 3 · samples 3" in result.out
    # Only the assistant's answer (and its end token) carries a loss: 11 bytes + </s>.
    assert "12 carry a loss" in result.out
    assert "What is the passkey?</s><|assistant|>\n⟧It is 4821.</s>" in result.out
    long_text = tmp_path / "long.jsonl"
    long_text.write_text(json.dumps({"text": "x" * 1000}) + "\n")
    result = cli("data", "--model", "tiny-llama", "--seq-len", "256", "--data", long_text, "--no-preview")
    assert "truncated records 1 (tokens dropped 746)" in result.out and "first sample" not in result.out
    _assert_user_error(cli("data", "--model", "tiny-llama"), "--data is required")


def test_data_preview_shows_the_trained_tokens_after_a_long_prompt(cli):
    """The passkey answer records: 3,480 tokens of which the last 7 are trained; the preview jumps to them."""
    result = cli("data", "--model", "tiny-llama", "--seq-len", "4k", "--data", "builtin:passkey-answer",
                 "--preview-tokens", "200")
    assert result.code == 0, result.err
    assert "7 carry a loss" in result.out and "the lead-up to the first trained token" in result.out
    assert "… 3,323 tokens" in result.out and "The pass key is ⟧60494.</s>" in result.out


def test_data_preview_of_a_mixture_with_a_chat_template(cli, tmp_path):
    """Several weighted sources add up their counts, and --chat-template is the template the mask is shown in."""
    alpaca, pairs = tmp_path / "alpaca.jsonl", tmp_path / "pairs.jsonl"
    alpaca.write_text("".join(json.dumps({"instruction": f"Say {w}", "input": "", "output": w}) + "\n"
                              for w in ("hi", "yes")))
    pairs.write_text(json.dumps({"prompt": "Q: 2+2?", "completion": " 4"}) + "\n")
    result = cli("data", "--model", "tiny-llama", "--seq-len", "256", "--data", f"{alpaca}:0.5", "--data",
                 f"{pairs}:0.5", "--chat-template", "chatml")
    assert result.code == 0, result.err
    assert "records 3 · samples 4" in result.out
    assert "⟦<|im_start|>user\nSay hi<|im_end|>\n<|im_start|>assistant\n⟧hi<|im_end|>" in result.out
