"""`lstune train` end to end on CPU with tiny models: learning, accumulation, checkpoints, resume, export."""

from __future__ import annotations

import json
import signal
import time

import pytest
import torch

from tests.integration.conftest import REPO, TINY_MODEL, read_metrics


def test_embedded_demo_recipe_learns(cli, tmp_path, monkeypatch):
    """The README's demo command as a user runs it: lstune picks the CPU threads (every core for one process), where
    the suite's one thread per test (tests/conftest.py) made it take twice as long on CI's 2 cores."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    out = tmp_path / "demo"
    result = cli("train", "--config", REPO / "recipes/tiny-llama/4k-cpu-demo.yaml", "--output-dir", out)
    assert result.code == 0, result.err
    metrics = read_metrics(out)
    assert [m["step"] for m in metrics] == list(range(1, len(metrics) + 1))
    first = sum(m["loss"] for m in metrics[:3]) / 3
    last = sum(m["loss"] for m in metrics[-3:]) / 3
    assert last < 0.6 * first, (first, last)
    required = {"step", "loss", "tokens", "tokens_per_s", "step_time_s", "lr", "grad_norm",
                "peak_device_mem_bytes", "host_rss_bytes"}
    assert required <= set(metrics[0])
    assert (out / "final" / "config.json").exists()
    assert "final model" in result.out
    # Validation on the 16 held-out passkey records every 20 steps: the answer-token loss and passkey accuracy.
    evals = [m for m in metrics if "eval_loss" in m]
    assert [m["step"] for m in evals] == [20, 40, 60] and all(m["eval_samples"] == 16 for m in evals)
    assert all(0.0 <= m["eval_passkey_acc"] <= 1.0 for m in evals)
    assert "passkey_acc" in result.out and "passkey accuracy (step 60)" in result.out
    # `auto` tiling from the estimate: a tiny model at 4K on a CPU is not cut into tiles (it was cut into 32).
    assert "tiled MLP off" in result.out and "loss plain (1 tile)" in result.out
    assert "cores ÷ 1 local process" in result.out  # the threads lstune chose, as for the README's command


def test_final_model_reloads_with_from_pretrained(cli, tmp_path, text_data):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "run"
    result = cli("train", *TINY_MODEL, "--data", text_data, "--max-steps", "3", "--output-dir", out)
    assert result.code == 0, result.err
    model = AutoModelForCausalLM.from_pretrained(out / "final")
    ckpt_model = AutoModelForCausalLM.from_pretrained(out / "checkpoint-3" / "model")
    for (name, a), (_, b) in zip(model.state_dict().items(), ckpt_model.state_dict().items()):
        assert torch.equal(a, b), name
    ids = torch.arange(3, 40).unsqueeze(0)
    assert torch.isfinite(model(input_ids=ids).logits).all()


def test_grad_accumulation_equals_bigger_batch(cli, tmp_path, text_data):
    common = [*TINY_MODEL, "--data", text_data, "--max-steps", "3", "--schedule", "constant"]
    assert cli("train", *common, "--micro-batch-size", "2", "--output-dir", tmp_path / "a").code == 0
    assert cli("train", *common, "--micro-batch-size", "1", "--grad-accum", "2", "--output-dir", tmp_path / "b").code == 0
    a, b = read_metrics(tmp_path / "a"), read_metrics(tmp_path / "b")
    assert [m["label_tokens"] for m in a] == [m["label_tokens"] for m in b]
    for ma, mb in zip(a, b):
        assert ma["loss"] == pytest.approx(mb["loss"], rel=1e-5)
        assert ma["grad_norm"] == pytest.approx(mb["grad_norm"], rel=1e-4)
    from safetensors.torch import load_file

    wa = load_file(tmp_path / "a/final/model.safetensors")
    wb = load_file(tmp_path / "b/final/model.safetensors")
    for key in wa:
        torch.testing.assert_close(wa[key], wb[key], rtol=1e-4, atol=1e-6)


def test_resume_equals_uninterrupted(cli, tmp_path, text_data):
    common = [*TINY_MODEL, "--data", text_data, "--max-steps", "10", "--seed", "7"]
    full = tmp_path / "full"
    assert cli("train", *common, "--save-every", "5", "--keep-last", "0", "--output-dir", full).code == 0
    assert (full / "checkpoint-5").is_dir() and (full / "checkpoint-10").is_dir()

    # A run stopped after 5 steps (same schedule), then resumed in place for the rest.
    part = tmp_path / "part"
    first = cli("train", *common, "--save-every", "5", "--output-dir", part, "--stop-at-step", "5")
    assert first.code == 0, first.err
    resumed = cli("train", *common, "--output-dir", part, "--resume")
    assert resumed.code == 0, resumed.err
    losses_full = [m["loss"] for m in read_metrics(full)]
    losses_part = [m["loss"] for m in read_metrics(part)]
    assert len(losses_part) == 10
    assert losses_part == pytest.approx(losses_full, rel=1e-6)


def test_five_step_run_resumed_for_five_more(cli, tmp_path, text_data):
    """The issue's promise, with a constant schedule so the two plans share their learning rates."""
    common = [*TINY_MODEL, "--data", text_data, "--schedule", "constant"]
    full, part = tmp_path / "full", tmp_path / "part"
    assert cli("train", *common, "--max-steps", "10", "--output-dir", full).code == 0
    assert cli("train", *common, "--max-steps", "5", "--output-dir", part).code == 0
    assert cli("train", *common, "--max-steps", "10", "--output-dir", part, "--resume").code == 0
    assert [m["loss"] for m in read_metrics(part)] == pytest.approx([m["loss"] for m in read_metrics(full)], rel=1e-6)
    again = cli("train", *common, "--max-steps", "10", "--output-dir", part, "--resume")  # a finished run
    assert again.code == 0 and "at step 10 of 10: nothing left to train" in " ".join(again.out.split())
    assert len(read_metrics(part)) == 10


def test_keep_last_prunes_old_checkpoints(cli, tmp_path, text_data):
    out = tmp_path / "run"
    assert cli("train", *TINY_MODEL, "--data", text_data, "--max-steps", "6", "--save-every", "2", "--keep-last", "2",
               "--output-dir", out).code == 0
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-4", "checkpoint-6"]


def test_corrupt_checkpoint_is_refused(cli, tmp_path, text_data):
    out = tmp_path / "run"
    assert cli("train", *TINY_MODEL, "--data", text_data, "--max-steps", "2", "--output-dir", out).code == 0
    weights = out / "checkpoint-2" / "model" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-10] ^= 0xFF
    weights.write_bytes(bytes(data))
    result = cli("train", *TINY_MODEL, "--data", text_data, "--max-steps", "4", "--output-dir", out, "--resume")
    assert result.code == 2 and "Traceback" not in result.err
    assert "checkpoint-2" in result.err and "corrupt" in result.err.lower()


def test_overwrite_replaces_only_our_files(cli, tmp_path, text_data):
    out = tmp_path / "run"
    assert cli("train", *TINY_MODEL, "--data", text_data, "--max-steps", "2", "--output-dir", out).code == 0
    (out / "notes.txt").write_text("mine")
    assert cli("train", *TINY_MODEL, "--data", text_data, "--max-steps", "1", "--output-dir", out, "--overwrite").code == 0
    assert (out / "notes.txt").read_text() == "mine"
    assert len(read_metrics(out)) == 1
    assert not (out / "checkpoint-2").exists()


def test_lora_trains_adapter_and_merged_export_reloads(cli, tmp_path, text_data):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "lora"
    result = cli("train", *TINY_MODEL, "--data", text_data, "--max-steps", "3", "--lora-r", "4", "--merge-lora",
                 "--output-dir", out)
    assert result.code == 0, result.err
    assert (out / "final" / "adapter_config.json").exists()
    merged = AutoModelForCausalLM.from_pretrained(out / "final-merged")
    assert not any("lora" in name for name in merged.state_dict())
    metrics = read_metrics(out)
    assert all(m["grad_norm"] > 0 for m in metrics)


def test_sigterm_saves_a_checkpoint_then_exits(tmp_path, text_data):
    out = tmp_path / "run"
    import subprocess
    import sys

    proc = subprocess.Popen(
        [sys.executable, "-m", "lstune", "train", *TINY_MODEL, "--data", str(text_data), "--max-steps", "100000",
         "--output-dir", str(out)],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    deadline = time.time() + 120
    while time.time() < deadline and not ((out / "metrics.jsonl").exists() and (out / "metrics.jsonl").read_text().count("\n") >= 2):
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr
    steps = len(read_metrics(out))
    assert (out / f"checkpoint-{steps}").is_dir(), (steps, list(out.iterdir()))
    assert not (out / "final").exists()
    assert "SIGTERM" in stdout + stderr


def test_packed_training_runs_and_counts_document_ends(cli, tmp_path, text_data):
    out = tmp_path / "packed"
    result = cli("train", *TINY_MODEL, "--data", text_data, "--pack", "--max-steps", "2", "--output-dir", out)
    assert result.code == 0, result.err
    metrics = read_metrics(out)
    # Packed windows are full of real tokens: only document ends (and the tail's padding) are ignored.
    assert metrics[0]["label_tokens"] > 0.9 * 256


def test_chat_data_trains_on_assistant_turns(cli, tmp_path):
    data = tmp_path / "chat.jsonl"
    rows = [{"messages": [{"role": "user", "content": f"Say {i}."}, {"role": "assistant", "content": f"{i} " * 20}]}
            for i in range(6)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "chat"
    result = cli("train", *TINY_MODEL, "--data", data, "--max-steps", "2", "--output-dir", out)
    assert result.code == 0, result.err
    metrics = read_metrics(out)
    assert 0 < metrics[0]["label_tokens"] < 100  # the assistant's ~40 tokens, not the prompt or padding


def test_attention_that_cannot_be_honoured_is_refused(cli, tmp_path, text_data):
    """Softcapped attention logits with --attn flex cannot run on CPU (no flex backward there): refused before
    training, not ignored. (Since issue 34, `auto`/`sdpa` softcap on CPU through lstune's block kernel.)"""
    from lstune.models.presets import preset_config

    folder = tmp_path / "softcapped"
    preset_config("tiny-gemma2", attn_logit_softcapping=50.0).save_pretrained(folder)
    result = cli("train", "--model", folder, "--init", "random", "--seq-len", "256", "--data", text_data,
                 "--attn", "flex", "--output-dir", tmp_path / "o")
    assert result.code == 2 and "Traceback" not in result.err
    assert "softcap" in result.err.lower()
    assert not (tmp_path / "o" / "metrics.jsonl").exists()


def test_resume_with_changed_settings_says_so(cli, tmp_path, text_data):
    out = tmp_path / "run"
    assert cli("train", *TINY_MODEL, "--data", text_data, "--max-steps", "2", "--output-dir", out).code == 0
    result = cli("train", *TINY_MODEL, "--data", text_data, "--max-steps", "3", "--grad-accum", "2", "--output-dir", out,
                 "--resume")
    assert result.code == 0, result.err
    assert "differ from the checkpoint" in result.out and "grad_accum 1 → 2" in result.out
    assert "max_steps 2 → 3" in result.out


def test_training_continues_from_a_final_model_folder(cli, tmp_path, text_data):
    first = tmp_path / "first"
    assert cli("train", *TINY_MODEL, "--data", text_data, "--max-steps", "2", "--output-dir", first).code == 0
    result = cli("train", "--model", first / "final", "--seq-len", "256", "--data", text_data, "--max-steps", "1",
                 "--output-dir", tmp_path / "second")
    assert result.code == 0, result.err
    assert "(local)" in result.out
    assert "no tokenizer shipped" not in result.out  # the byte tokenizer saved with the model is found
    assert "randomly initialised" not in result.out


def test_lora_final_loads_with_auto_classes_and_files_follow_the_umask(cli, tmp_path, text_data):
    """final/ of a LoRA run on a local model names its base by absolute path (AutoModelForCausalLM loads the
    adapter on it), its byte tokenizer loads with AutoTokenizer, and every file has the user's umask."""
    import os
    import stat

    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = tmp_path / "base"
    assert cli("train", *TINY_MODEL, "--data", text_data, "--max-steps", "1", "--output-dir", base).code == 0
    out = tmp_path / "lora"
    previous = os.umask(0o027)
    try:
        result = cli("train", *TINY_MODEL, "--model", base / "final", "--data", text_data, "--max-steps", "2",
                     "--lora-r", "4", "--save-every", "1", "--output-dir", out)
    finally:
        os.umask(previous)
    assert result.code == 0, result.err
    adapter = json.loads((out / "final" / "adapter_config.json").read_text())
    assert adapter["base_model_name_or_path"] == str((base / "final").resolve())
    model = AutoModelForCausalLM.from_pretrained(out / "final")
    assert any("lora_A" in name for name, _ in model.named_parameters())
    assert (out / "metrics.png").is_file(), "the end-of-run plot"
    last = read_metrics(out)[-1]
    assert all(last[key] > 0 for key in ("forward_s", "backward_s", "optimizer_s")), last
    assert last["forward_s"] + last["backward_s"] + last["optimizer_s"] <= last["step_time_s"]
    tokenizer = AutoTokenizer.from_pretrained(out / "final")
    assert tokenizer.encode("abc") == [1, 97 + 3, 98 + 3, 99 + 3]
    for folder in ("final", "checkpoint-2"):
        for path in [out / folder, *(out / folder).rglob("*")]:
            mode = stat.S_IMODE(path.stat().st_mode)
            assert mode == (0o750 if path.is_dir() else 0o640), (path, oct(mode))
