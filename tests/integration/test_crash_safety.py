"""Crashes and divergence: a killed run's lock, a kill during pruning, NaN losses, SIGTERM while loading,
and a DeepSpeed checkpoint crafted to run code on resume."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.integration.conftest import REPO, TINY_MODEL, read_metrics, run_subprocess


def _start(*args: str) -> subprocess.Popen:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "lstune", *map(str, args)], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for(predicate, timeout: float = 120, poll: float = 0.1) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return
        time.sleep(poll)
    raise AssertionError("timed out")


def test_lock_refuses_a_second_run_and_a_killed_runs_lock_is_taken_over(tmp_path, text_data):
    out = tmp_path / "run"
    first = _start("train", *TINY_MODEL, "--data", text_data, "--max-steps", "100000", "--save-every", "2",
                   "--output-dir", out)
    try:
        _wait_for(lambda: (out / "checkpoint-2").is_dir())
        second = run_subprocess("train", *TINY_MODEL, "--data", text_data, "--max-steps", "3", "--output-dir", out,
                                "--resume", timeout=120)
        assert second.returncode == 2, second.stderr
        assert "Traceback" not in second.stderr
        assert "in use by another lstune run" in second.stderr and f"pid {first.pid}" in second.stderr
    finally:
        first.kill()  # SIGKILL: no handler runs, the lock file stays behind
        first.communicate(timeout=60)
    assert (out / ".lstune.lock").exists()
    steps = max(int(p.name.split("-")[1]) for p in out.glob("checkpoint-*"))
    third = run_subprocess("train", *TINY_MODEL, "--data", text_data, "--max-steps", str(steps + 1), "--output-dir", out,
                           "--resume", timeout=180)
    assert third.returncode == 0, third.stderr
    assert "taking over the lock" in (out / "lstune.log").read_text()
    assert not (out / ".lstune.lock").exists()


_PRUNE_KILLED = textwrap.dedent("""
    import os, shutil, sys
    from pathlib import Path
    from lstune.train.checkpoint import save_checkpoint

    out = Path(sys.argv[1])
    write = lambda d: [(d / f"part{i}.bin").write_bytes(os.urandom(4096)) for i in range(5)]
    for step in (1, 2):
        save_checkpoint(out, step, write_state=write, train_state={}, keep_last=2)
    real = shutil.rmtree
    def killed_midway(path, *a, **k):
        files = sorted(Path(path).iterdir())
        files[0].unlink()  # part of the folder is gone when the kill lands
        os._exit(9)
    shutil.rmtree = killed_midway
    save_checkpoint(out, 3, write_state=write, train_state={}, keep_last=2)
""")


def test_a_kill_during_pruning_leaves_no_broken_checkpoint(tmp_path):
    from lstune.train.checkpoint import MANIFEST_NAME, find_latest_checkpoint, save_checkpoint

    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-c", _PRUNE_KILLED, str(out)], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 9, proc.stderr
    checkpoints = sorted(p.name for p in out.glob("checkpoint-*"))
    assert checkpoints == ["checkpoint-2", "checkpoint-3"]
    assert all((out / name / MANIFEST_NAME).is_file() for name in checkpoints)
    assert [p.name.startswith(".pruned-checkpoint-1-") for p in out.glob(".pruned-*")] == [True]
    assert find_latest_checkpoint(out) == out / "checkpoint-3"
    save_checkpoint(out, 4, write_state=lambda d: (d / "x.bin").write_bytes(b"x"), train_state={}, keep_last=2)
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-3", "checkpoint-4"]


def test_nan_loss_stops_the_run_keeping_the_last_good_checkpoint(cli, tmp_path, text_data):
    out = tmp_path / "run"
    result = cli("train", *[a for a in TINY_MODEL if a not in ("--lr", "1e-3")], "--lr", "1e30", "--data", text_data,
                 "--max-steps", "8", "--save-every", "1", "--output-dir", out)
    assert result.code == 2 and "Traceback" not in result.err
    assert "training diverged" in result.err and "nan" in result.err
    bad_step = next(m["step"] for m in read_metrics(out) if m["loss"] != m["loss"] or m["grad_norm"] != m["grad_norm"])
    newest = max(int(p.name.split("-")[1]) for p in out.glob("checkpoint-*"))
    assert newest == bad_step - 1
    assert f"checkpoint-{newest}" in result.err
    assert not (out / "final").exists()


def test_a_nonfinite_update_is_never_applied_and_can_be_skipped():
    import torch

    from lstune.optim import OptimConfig
    from lstune.train.engine import TorchEngine
    from lstune.train.guard import DivergedError, NonFiniteGuard

    model = torch.nn.Linear(4, 4)
    cfg = OptimConfig(lr=0.1, weight_decay=0.0, betas=(0.9, 0.99), eps=1e-8, warmup_steps=0, max_steps=10,
                      schedule="constant", min_lr_ratio=0.0, max_grad_norm=1.0)
    engine = TorchEngine(model, cfg)
    before = [p.detach().clone() for p in model.parameters()]
    (model(torch.ones(1, 4)).sum() * float("nan")).backward()
    stats = engine.step()
    assert stats["update_skipped"] and stats["grad_norm"] != stats["grad_norm"]
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    record = {"step": 1, "loss": float("nan"), "grad_norm": float("nan"), "update_skipped": True}
    assert "skipped" in NonFiniteGuard(skip=True).check(record, None)
    with pytest.raises(DivergedError, match="diverged"):
        NonFiniteGuard(skip=False).check(record, None)
    guard = NonFiniteGuard(skip=True)
    with pytest.raises(DivergedError, match="in a row"):
        for _ in range(11):
            guard.check(record, None)


def test_sigterm_while_loading_exits_130_with_a_message(tmp_path, text_data):
    out = tmp_path / "run"
    proc = _start("train", *TINY_MODEL, "--data", text_data, "--max-steps", "3", "--output-dir", out)
    # The lock is taken before the estimate, the data and the model: from then on the run is loading, seconds
    # before its first step. (The log's first line, waited for before, comes a fraction of a second before the
    # steps of a tiny model: a signal could land in the steps, which save a checkpoint instead.)
    _wait_for(lambda: (out / ".lstune.lock").exists(), timeout=120, poll=0.005)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr
    assert "SIGTERM received before training started" in stderr and "Traceback" not in stderr
    assert not (out / ".lstune.lock").exists()


_PAYLOAD = textwrap.dedent("""
    import os, sys, torch
    path, marker = sys.argv[1], sys.argv[2]

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    state = torch.load(path, weights_only=False)
    state["payload"] = Payload()
    torch.save(state, path)
""")


def _recompute_manifest(checkpoint: Path) -> None:
    """What an attacker does so that lstune's hash check passes."""
    import hashlib

    manifest_path = checkpoint / "lstune-checkpoint.json"
    manifest = json.loads(manifest_path.read_text())
    for entry in manifest["files"]:
        data = (checkpoint / entry["path"]).read_bytes()
        entry.update(size=len(data), sha256=hashlib.sha256(data).hexdigest())
    manifest_path.write_text(json.dumps(manifest))


@pytest.mark.slow
def test_a_crafted_deepspeed_checkpoint_runs_no_code_on_resume(tmp_path, text_data):
    out, marker = tmp_path / "run", tmp_path / "pwned"
    common = [*TINY_MODEL, "--data", text_data, "--zero-stage", "1", "--output-dir", out]
    first = run_subprocess("train", *common, "--max-steps", "1", timeout=300)
    assert first.returncode == 0, first.stderr
    optim = next((out / "checkpoint-1" / "deepspeed").glob("*optim_states.pt"))
    subprocess.run([sys.executable, "-c", _PAYLOAD, str(optim), str(marker)], check=True, timeout=120)
    _recompute_manifest(out / "checkpoint-1")

    refused = run_subprocess("train", *common, "--max-steps", "2", "--resume", timeout=300)
    assert refused.returncode == 2, refused.stderr
    assert "Traceback" not in refused.stderr and "--trust-checkpoint" in refused.stderr
    assert "optim_states.pt" in refused.stderr and "execute" in refused.stderr
    assert not marker.exists()

    # The same file with the user's word for it: DeepSpeed's own loader runs the payload, which shows that
    # the refusal above is what kept it from running.
    trusted = run_subprocess("train", *common, "--max-steps", "2", "--resume", "--trust-checkpoint", timeout=300)
    assert marker.exists(), trusted.stderr


def test_sigterm_during_a_save_stops_right_after_it(cli, tmp_path, text_data, monkeypatch):
    from lstune.train import engine as engine_module

    real_save = engine_module.TorchEngine.save

    def save_and_get_terminated(self, ckpt_dir):
        real_save(self, ckpt_dir)
        os.kill(os.getpid(), signal.SIGTERM)  # lands while the checkpoint is being written

    monkeypatch.setattr(engine_module.TorchEngine, "save", save_and_get_terminated)
    out = tmp_path / "run"
    result = cli("train", *TINY_MODEL, "--data", text_data, "--max-steps", "10", "--save-every", "2", "--output-dir", out)
    assert result.code == 130, result.err
    assert [m["step"] for m in read_metrics(out)] == [1, 2]  # no further step after the save
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2"]


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs needs root")
def test_a_really_full_disk_names_the_path(cli, tmp_path, text_data):
    """A 24 MiB tmpfs holds two 9.5 MiB checkpoints of tiny-llama, not a third."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", str(disk)]).returncode != 0:
        pytest.skip("tmpfs cannot be mounted here")
    try:
        out = disk / "run"
        result = cli("train", *TINY_MODEL, "--data", text_data, "--max-steps", "6", "--save-every", "1", "--keep-last", "0",
                     "--output-dir", out)
        assert result.code == 2 and "Traceback" not in result.err, result.err
        assert "no space left" in result.err and "could not write" in result.err
        # Said at the start (lstune.train.disk_space): six saves, all kept.
        said = " ".join((result.out + result.err).split())
        assert "it saves 6 checkpoint(s)" in said and "keeps all of them, so up to 6 at once" in said, said[:3000]
        newest = max(int(p.name.split("-")[1]) for p in out.glob("checkpoint-*"))
        assert f"checkpoint-{newest} is intact" in result.err
        from lstune.train.checkpoint import validate_checkpoint

        validate_checkpoint(out / f"checkpoint-{newest}")  # complete, every hash matching
        assert not list(out.glob(".tmp-*"))
    finally:
        subprocess.run(["umount", str(disk)])


def test_sigterm_after_the_steps_names_the_saved_checkpoint(cli, tmp_path, text_data, monkeypatch):
    """A SIGTERM once the steps are over (here: during the summary) stops with 130 and says what is saved, not that
    nothing had been trained."""
    import lstune.cli.render
    from lstune.train.signals import Terminated

    def terminated(result):
        raise Terminated("SIGTERM")  # what the CLI's SIGTERM handler raises wherever the process is

    monkeypatch.setattr(lstune.cli.render, "print_summary", terminated)
    out = tmp_path / "run"
    result = cli("train", *TINY_MODEL, "--data", text_data, "--max-steps", "2", "--output-dir", out)
    assert result.code == 130, result.err
    assert f"SIGTERM received after the training steps; stopped. The newest checkpoint, {out / 'checkpoint-2'}" in result.err
    assert "before training started" not in result.err
    assert (out / "checkpoint-2").is_dir() and (out / "final").is_dir()


def test_a_sigterm_whose_exception_was_lost_while_loading_still_stops_before_training(cli, tmp_path, text_data,
                                                                                      monkeypatch):
    """CPython's compile() can clear the exception a signal handler raised while it compiled a module (no .pyc), and
    the import goes on; the run must stop all the same, before its first step, with the usual message."""
    import signal as signals

    import lstune.train.run
    from lstune.train.signals import Terminated, on_sigterm

    real = lstune.train.run._setup_tokenizer

    def loses_the_exception(*args, **kwargs):
        try:
            on_sigterm(signals.SIGTERM, None)
        except Terminated:
            pass  # what compile() did with it
        return real(*args, **kwargs)

    monkeypatch.setattr(lstune.train.run, "_setup_tokenizer", loses_the_exception)
    out = tmp_path / "run"
    result = cli("train", *TINY_MODEL, "--data", text_data, "--max-steps", "2", "--output-dir", out)
    assert result.code == 130, result.err
    assert "SIGTERM received before training started" in result.err
    assert not list(out.glob("checkpoint-*")) and not (out / "metrics.jsonl").exists()
