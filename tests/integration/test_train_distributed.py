"""`lstune train --gpus N` on CPU: N gloo processes launched by lstune itself, with Ulysses SP and ZeRO."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from tests.integration.conftest import REPO, TINY_MODEL, read_metrics, run_subprocess, write_text_data


def _train(*args, timeout=400):
    proc = run_subprocess("train", *TINY_MODEL, *args, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "terminate called" not in proc.stderr and "is deprecated" not in proc.stderr, proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """The flags the SP=2, ring and METP runs share (3 steps, clipping at 0.5, 3 held-out samples evaluated at steps
    2 and 3), and one process's run accumulating 2 samples a step: the reference each of them must equal (made once
    for the module: it had been made once per test)."""
    root = tmp_path_factory.mktemp("shared")
    common = ["--data", write_text_data(root / "data.jsonl"), "--max-steps", "3", "--max-grad-norm", "0.5",
              "--eval-split", "0.25", "--eval-every", "2"]
    _train(*common, "--grad-accum", "2", "--output-dir", root / "one")
    return SimpleNamespace(common=common, one_dir=root / "one", one=read_metrics(root / "one"))


def _equals_one_process(run: list[dict], one: list[dict]) -> None:
    """A multi-process run's numbers are one process's accumulating the same samples: loss, gradient norm and the
    validation (the exact global mean, at steps 2 and 3)."""
    assert [m["label_tokens"] for m in run] == [m["label_tokens"] for m in one]
    assert [m["loss"] for m in run] == pytest.approx([m["loss"] for m in one], rel=1e-5)
    assert [m["grad_norm"] for m in run] == pytest.approx([m["grad_norm"] for m in one], rel=1e-4)
    evals = lambda ms: [(m["step"], m["eval_tokens"], m["eval_loss"]) for m in ms if "eval_loss" in m]  # noqa: E731
    assert [e[:2] for e in evals(run)] == [e[:2] for e in evals(one)] and [e[0] for e in evals(one)] == [2, 3]
    assert [e[2] for e in evals(run)] == pytest.approx([e[2] for e in evals(one)], rel=1e-5)


def test_sp2_over_two_processes_equals_one_process(tmp_path, shared):
    """SP=2 on 2 processes sees 2 samples per step: the same numbers as 1 process accumulating 2, validation
    included (3 held-out samples, at steps 2 and 3)."""
    _train(*shared.common, "--gpus", "2", "--sp", "2", "--output-dir", tmp_path / "sp2")
    _equals_one_process(read_metrics(tmp_path / "sp2"), shared.one)


def test_zero3_sp_resume_equals_one_process_and_export_reloads(tmp_path, shared):
    """ZeRO-3 under SP=2: a run stopped at step 2 and resumed has the numbers of one process accumulating the same
    samples (`shared`'s uninterrupted run: every step's loss and gradient norm, clipping and validation), so it
    continues exactly as an uninterrupted run would (the reference was a third, uninterrupted ZeRO-3 launch, itself
    equal to one process); its export reloads with transformers; the plan counts the model's parameters."""
    from transformers import AutoModelForCausalLM

    from lstune.estimate.memory import saved_checkpoint_min_bytes

    common = [*shared.common, "--gpus", "2", "--sp", "2", "--zero-stage", "3"]
    _train(*common, "--output-dir", tmp_path / "part", "--stop-at-step", "2")
    assert (tmp_path / "part" / "checkpoint-2").is_dir()
    saved = sum(f.stat().st_size for f in (tmp_path / "part" / "checkpoint-2").rglob("*") if f.is_file())
    shown = _train(*common, "--output-dir", tmp_path / "part", "--resume").stdout
    _equals_one_process(read_metrics(tmp_path / "part"), shared.one)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "part" / "final")
    count = sum(p.numel() for p in model.parameters())
    # The plan counts the model's parameters, not the empty placeholders ZeRO-3 leaves on each rank.
    assert re.search(rf"^\s*parameters\s+{count:,}\s*$", shown, re.M) and count > 0, shown[:2000]
    assert re.search(rf"^\s*trainable parameters\s+{count:,}\s*$", shown, re.M), shown[:2000]
    # The disk check's least bytes of a checkpoint (lstune.train.disk_space) hold for ZeRO-3's shards over 2 ranks.
    need = saved_checkpoint_min_bytes(SimpleNamespace(trainable=count))
    assert need <= saved <= 1.15 * need, (need, saved)


def test_invalid_sp_degree_is_refused_before_launch(tmp_path, text_data):
    proc = run_subprocess("train", *TINY_MODEL, "--data", text_data, "--gpus", "2", "--sp", "3",
                          "--output-dir", tmp_path / "o", timeout=120)
    assert proc.returncode == 2
    assert "--sp 3" in proc.stderr and "1, 2" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_lora_with_tiling_under_zero3_and_sp_equals_one_process(tmp_path, text_data):
    """Every technique composed: LoRA + tiled MLP + tiled loss + offloaded checkpoints, ZeRO-3, SP=2."""
    # 3 validation samples on 2 processes under ZeRO-3: one rank runs a blank sample to keep the gathers in step.
    common = ["--data", text_data, "--max-steps", "2", "--lora-r", "4", "--tiled-mlp", "3", "--tiled-loss", "3",
              "--offload-checkpoints", "--eval-data", text_data, "--eval-max-samples", "3"]
    _train(*common, "--gpus", "2", "--sp", "2", "--zero-stage", "3", "--output-dir", tmp_path / "sp2")
    _train(*common, "--grad-accum", "2", "--output-dir", tmp_path / "one")
    sp2, one = read_metrics(tmp_path / "sp2"), read_metrics(tmp_path / "one")
    assert [m["loss"] for m in sp2] == pytest.approx([m["loss"] for m in one], rel=1e-5)
    assert [m["grad_norm"] for m in sp2] == pytest.approx([m["grad_norm"] for m in one], rel=1e-4)
    assert "eval_loss" not in sp2[0] and sp2[1]["eval_tokens"] == one[1]["eval_tokens"] > 0
    assert sp2[1]["eval_loss"] == pytest.approx(one[1]["eval_loss"], rel=1e-5)
    assert (tmp_path / "sp2" / "final" / "adapter_config.json").exists()


def test_bad_data_on_two_processes_is_one_message_and_exit_code_2(tmp_path):
    """The main process's data error stops the others quietly (no connection error from a rank waiting on it) and
    the launcher adds no traceback or report of its own."""
    data = tmp_path / "bad.jsonl"
    data.write_text('{"foo": 1}\n')
    proc = run_subprocess("train", *TINY_MODEL, "--data", data, "--gpus", "2", "--output-dir", tmp_path / "o",
                          timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.count("lstune: the records have columns ['foo']") == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "FAILED" not in proc.stderr, proc.stderr[-3000:]


def test_a_refusal_every_rank_makes_is_printed_once(tmp_path):
    """Each rank checks the fit (rank 0's estimate, broadcast) and refuses alike: one message, not one per rank."""
    proc = run_subprocess("train", "--model", "llama-3.1-8b", "--seq-len", "64k", "--data", "builtin:passkey",
                          "--gpus", "2", "--output-dir", tmp_path / "o", timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.count("is predicted not to fit") == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]


def _start(out, *flags):
    """`lstune train --gpus 2` in a session of its own (a terminal's Ctrl-C reaches its whole process group)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "lstune", "train", *TINY_MODEL, "--data", "builtin:passkey", "--gpus", "2",
               "--sp", "2", "--max-steps", "100000", "--output-dir", str(out), *flags]
    return subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


@pytest.mark.parametrize("how", ["ctrl-c", "sigterm"])
def test_a_stopped_two_process_run_saves_a_checkpoint_and_exits_130(tmp_path, how):
    """Ctrl-C (SIGINT to the terminal's process group: every process, and torchrun passes it on once more) or
    SIGTERM to `lstune` alone (passed to torchrun, then to the ranks): each rank finishes its step, the checkpoint
    is saved, `lstune` waits for it and exits 130 without a traceback."""
    out = tmp_path / "run"
    proc = _start(out)
    try:
        deadline = time.monotonic() + 240
        while not (out / "metrics.jsonl").exists() or not (out / "metrics.jsonl").read_text().strip():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.2)
        if how == "ctrl-c":
            os.killpg(proc.pid, signal.SIGINT)
        else:
            proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, stderr[-3000:]
    assert "received: saving a checkpoint, then stopping" in stdout, stdout[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    newest = max(out.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
    assert (newest / "lstune-checkpoint.json").is_file() and f"checkpoint saved: {newest}" in stdout
    assert not (out / ".lstune.lock").exists()
    with pytest.raises(ProcessLookupError):  # lstune returned only once its processes had ended
        os.killpg(proc.pid, 0)


def test_ring_attention_run_equals_one_process_and_resumes_only_in_its_layout(tmp_path, shared):
    """--sp 2 --sp-ring 2 --attn-chunks 2 (chunked attention under the ring: the zigzag inside each chunk) through
    the CLI: the numbers of one process accumulating the same samples (`shared`'s run: validation and clipping
    included); a resume continues exactly; a resume under another layout (no ring, or another chunk setting under
    the ring) is refused (exit 2). Ring attention without chunks is the bench's SP-layout rung (test_bench_cli) and
    tests/distributed/test_ring_sp.py."""
    common = shared.common
    ring = [*common, "--gpus", "2", "--sp", "2", "--sp-ring", "2", "--attn-chunks", "2"]
    shown = _train(*ring, "--output-dir", tmp_path / "ring").stdout
    assert "ring 2" in shown and "attention in 2 chunks" in shown, shown[:2000]
    full = read_metrics(tmp_path / "ring")
    _equals_one_process(full, shared.one)
    _train(*ring, "--output-dir", tmp_path / "part", "--stop-at-step", "2")
    for other_layout, refused in ((["--gpus", "2", "--sp", "2", "--attn-chunks", "2"], "--sp-ring 2 (now 1)"),
                                  (["--gpus", "2", "--sp", "2", "--sp-ring", "2", "--attn-chunks", "off"],
                                   "--attn-chunks 2 (now off)")):
        other = run_subprocess("train", *TINY_MODEL, *common, *other_layout, "--output-dir", tmp_path / "part",
                               "--resume", timeout=400)
        assert other.returncode == 2, other.stderr[-3000:]
        assert refused in other.stderr and "Traceback" not in other.stderr, other.stderr[-3000:]
    _train(*ring, "--output-dir", tmp_path / "part", "--resume")
    part = read_metrics(tmp_path / "part")
    assert [m["loss"] for m in part] == [m["loss"] for m in full]


def test_metp_mlp_run_equals_one_process_resumes_only_in_its_layout_and_exports_full_weights(tmp_path, shared):
    """--metp-mlp on 2 processes (ZeRO-1, each rank training its MLP shards beside DeepSpeed): the numbers of one
    process accumulating the same samples (`shared`'s run), clipping and validation included; the exported model
    holds the full MLP weights (loaded with transformers, equal to the one-process run's); a resume continues
    exactly, one without --metp-mlp is refused (exit 2)."""
    import torch
    from transformers import AutoModelForCausalLM

    common = shared.common  # clipping at 0.5 among them
    metp = [*common, "--gpus", "2", "--sp", "2", "--metp-mlp"]
    shown = _train(*metp, "--output-dir", tmp_path / "metp").stdout
    assert "METP MLP: 1/2 of its weights per rank" in shown, shown[:2000]
    full, one = read_metrics(tmp_path / "metp"), shared.one
    _equals_one_process(full, one)
    assert all(m["grad_norm"] > 0.5 for m in one)  # clipping was active
    exported = dict(AutoModelForCausalLM.from_pretrained(tmp_path / "metp" / "final").named_parameters())
    reference = dict(AutoModelForCausalLM.from_pretrained(shared.one_dir / "final").named_parameters())
    mlp = [n for n in reference if ".mlp." in n]
    assert mlp and exported.keys() == reference.keys()
    count = sum(p.numel() for p in reference.values())  # the plan counts the MLP weights the shards make up
    assert re.search(rf"^\s*parameters\s+{count:,}\s*$", shown, re.M), shown[:2000]
    for name in mlp:  # full [I, H] / [H, I] weights, trained as one process trains them
        assert exported[name].shape == reference[name].shape
        scale = float(reference[name].detach().abs().max())
        torch.testing.assert_close(exported[name], reference[name], rtol=0, atol=1e-4 * scale)
    _train(*metp, "--output-dir", tmp_path / "part", "--stop-at-step", "2")
    other = run_subprocess("train", *TINY_MODEL, *common, "--gpus", "2", "--sp", "2", "--output-dir",
                           tmp_path / "part", "--resume", timeout=400)
    assert other.returncode == 2, other.stderr[-3000:]
    assert "--metp-mlp True (now False)" in other.stderr and "Traceback" not in other.stderr, other.stderr[-3000:]
    _train(*metp, "--output-dir", tmp_path / "part", "--resume")
    part = read_metrics(tmp_path / "part")
    assert [m["loss"] for m in part] == [m["loss"] for m in full]


def test_metp_mlp_refusals_are_refused_before_launch(tmp_path, text_data):
    """--metp-mlp with --sp 1 or with MLP tiles: exit 2 with the reason, before any process starts. (Chunked
    attention under a ring, once refused here too, runs since issue 35: test_ring_attention_run_equals_one_process...)"""
    base = ["train", *TINY_MODEL, "--data", text_data, "--gpus", "2", "--sp", "2"]
    proc = run_subprocess(*base, "--metp-mlp", "--tiled-mlp", "2", "--output-dir", tmp_path / "o", timeout=120)
    assert proc.returncode == 2 and "--tiled-mlp off" in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    proc = run_subprocess("train", *TINY_MODEL, "--data", text_data, "--gpus", "2", "--sp", "1", "--metp-mlp",
                          "--output-dir", tmp_path / "s", timeout=120)
    assert proc.returncode == 2 and "--sp 1 has none" in proc.stderr, proc.stderr[-2000:]


def test_llama4_packed_with_chunked_attention_under_sp2_equals_one_process(tmp_path, text_data):
    """Llama-4 (chunked-attention layer in 16-token chunks, NoPE layer with its temperature from positions,
    lstune.models.llama4) with --pack and FPDT: two SP ranks train the same numbers as one process."""
    from tests.support.archs import tiny_config

    tiny_config("llama4_text").save_pretrained(tmp_path / "llama4")
    common = ["--model", tmp_path / "llama4", "--data", text_data, "--seq-len", "128", "--max-steps", "3", "--init",
              "random", "--lr", "1e-3", "--warmup-steps", "0", "--pack", "--attn-chunks", "2"]
    for name, extra in (("sp2", ["--gpus", "2", "--sp", "2"]), ("one", ["--grad-accum", "2"])):
        proc = run_subprocess("train", *common, *extra, "--output-dir", tmp_path / name, timeout=600)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert "self-check passed" in proc.stdout + proc.stderr
    sp2, one = read_metrics(tmp_path / "sp2"), read_metrics(tmp_path / "one")
    assert [m["label_tokens"] for m in sp2] == [m["label_tokens"] for m in one]
    assert [m["loss"] for m in sp2] == pytest.approx([m["loss"] for m in one], rel=1e-5)
    assert [m["grad_norm"] for m in sp2] == pytest.approx([m["grad_norm"] for m in one], rel=1e-4)
