"""`lstune bench` end to end on a tiny preset: the ablation ladder with the longest-sequence search under a host
memory cap, and the files it writes; bad input exits 2 with a message; `bench --help` imports no torch."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.integration.conftest import light_help, light_run

MiB = 2**20


def test_bench_help_is_light_and_lists_the_bench_flags():
    out = light_help("bench")
    for flag in ("--ablation", "--find-max-len", "--lengths", "--max-host-mem", "--steps", "--seq-len", "--lora-r"):
        assert flag in out


@pytest.mark.parametrize("args, words", [
    (["--rungs", "hf,fast"], ["--rungs 'fast'", "tiled_mlp"]),
    (["--lengths", "16k,lots"], ["--lengths", "'lots'", "32k"]),
    (["--steps", "0"], ["--steps", "at least 1"]),
    (["--rungs", "sp"], ["--gpus 2"]),
    (["--model", "no-such-model-xyz"], ["no-such-model-xyz"]),
    (["--max-host-mem", "0"], ["--max-host-mem '0'", "256 MiB", "2G"]),
    # What `lstune train` refuses before loading anything is refused before any trial, not recorded per trial.
    (["--data", "/nonexistent.jsonl"], ["/nonexistent.jsonl", "no such file"]),
    (["--gpus", "2", "--sp", "3"], ["--sp 3 does not fit 2 process(es)", "use one of 1, 2"]),
    (["--lora-r", "16", "--load-in-4bit"], ["--load-in-4bit", "initialised at random", "drop --load-in-4bit"]),
])
def test_bad_input_exits_2_naming_the_problem(cli, tmp_path, args, words):
    result = cli("bench", "--model", "tiny-llama", "--seq-len", "512", "--output-dir", tmp_path / "b", *args)
    assert result.code == 2, result.err + result.out
    assert all(w in result.err for w in words), result.err
    assert "Traceback" not in result.err and not (tmp_path / "b").exists()  # no trials/, nothing written
    assert "trial" not in result.out


@pytest.mark.parametrize("args", [["--steps", "0"], ["--lr", "fast"], ["--max-host-mem", "0"]])
def test_a_config_error_answers_without_loading_the_model_libraries(tmp_path, args):
    """The cheap checks come first, and the model's config (transformers: seconds to import) is read only once
    they pass: a typo answers in about a second."""
    proc = light_run(["bench", "--model", "tiny-llama", "--output-dir", tmp_path / "b", *args], code=2)
    assert args[0] in proc.stderr and not (tmp_path / "b").exists()


def test_ablation_with_the_longest_sequence_search_under_a_host_cap(cli, tmp_path):
    # A first bench gives a trial process's RSS over two steps at 256 tokens (what a search trial runs); the cap
    # sits 12 MiB above it, so the rungs run out of host memory between 256 and 1K tokens (plain HF takes ~20 MiB
    # more at 1K than at 256).
    first = cli("bench", "--model", "tiny-llama", "--seq-len", "256", "--rungs", "hf", "--warmup", "1",
                "--steps", "1", "--output-dir", tmp_path / "probe")
    assert first.code == 0, first.err + first.out
    probe = json.loads((tmp_path / "probe" / "bench.json").read_text())["measurements"][0]
    cap = probe["peak_rss"] + 12 * MiB

    out = tmp_path / "bench"
    result = cli("bench", "--model", "tiny-llama", "--seq-len", "256", "--ablation", "--find-max-len",
                 "--len-step", "256", "--max-len", "1k", "--max-host-mem", str(cap), "--warmup", "0", "--steps", "1",
                 "--output-dir", out)
    assert result.code == 0, result.err + result.out
    bench = json.loads((out / "bench.json").read_text())
    ladder = ["hf", "tiled_loss", "tiled_mlp", "offload", "mini_seq"]
    # lstune's defaults close the ladder: their `auto` settings are the estimate's, no rung's.
    assert [r["name"] for r in bench["rungs"]] == [*ladder, "lstune"]
    assert bench["command"].startswith("lstune bench --model tiny-llama") and "--ablation" in bench["command"]
    assert bench["fingerprint"]["versions"]["torch"] and "host_ram_bytes" in bench["fingerprint"]
    assert bench["rungs"][0]["config"]["tiled_loss"] == "off" and bench["rungs"][2]["config"]["tiled_mlp"] == "auto"

    trials = {t["id"]: t for t in bench["trials"]}
    for rung in ladder:
        search = bench["searches"][rung]
        outcomes = {trials[i]["seq_len"]: trials[i]["outcome"] for i in search["trials"]}
        assert 256 <= search["longest_ok"] <= 1024 and outcomes[search["longest_ok"]] == "ok"
        if search["shortest_failed"] is not None:  # else every length up to --max-len fitted
            assert search["shortest_failed"] == search["longest_ok"] + 256
            assert outcomes[search["shortest_failed"]] == "host-oom"
        assert all(trials[i]["peak_rss_sampled"] > 0 and trials[i]["wall_s"] > 0 for i in search["trials"])
        assert bench["estimates"][rung] and bench["estimates"][rung][0]["device_peak_bytes"] > 0
    assert any(bench["searches"][r]["shortest_failed"] for r in ladder)  # the cap stopped some trial
    for m in bench["measurements"]:  # each rung at the common length
        assert m["outcome"] == "ok" and m["seq_len"] == 256
        assert m["tokens_per_s"] > 0 and 0 < m["mfu"] and m["hardware_tflops"] >= m["model_tflops"] > 0
        assert m["peak_rss"] <= cap and m["estimate"]["device_peak_bytes"] > 0
        # No device on a CPU: no error of the device estimate against RSS (issue 32); the step time's stays.
        assert m["estimate_peak_error_pct"] is None and m["estimate_time_error_pct"] is not None
    assert len(bench["measurements"]) == 6

    markdown = (out / "bench.md").read_text()
    for words in ("## Step time, throughput, memory", "## Longest sequence that completes a training step",
                  "plain HF", "+ tiled MLP", "host-oom", "| configuration |"):
        assert words in markdown
    for name in ("longest.png", "peak-vs-length.png", "tokens-per-s.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "longest sequence completing a step" in result.out and "trials in" in result.out

    recorded = set(json.loads((out / "lstune-bench-files.json").read_text())["entries"])
    assert recorded == {p.relative_to(out).as_posix() for p in out.rglob("*")} - {"lstune-bench-files.json"}
    again = cli("bench", "--model", "tiny-llama", "--output-dir", out)
    assert again.code == 2 and "--overwrite" in again.err


@pytest.mark.parametrize("overwrite", [[], ["--overwrite"]])
def test_the_users_files_at_the_bench_names_stop_it_before_any_trial(cli, tmp_path, overwrite):
    out = tmp_path / "b1"
    (out / "trials").mkdir(parents=True)
    (out / "tokens-per-s.png").write_text("x\n")
    (out / "trials" / "trial-1.log").write_text("mylog\n")
    result = cli("bench", "--model", "tiny-llama", "--seq-len", "256", "--lengths", "256", "--steps", "1",
                 "--warmup", "0", "--output-dir", out, *overwrite)
    assert result.code == 2 and "Traceback" not in result.err, result.err
    assert "tokens-per-s.png" in result.err and "trials/trial-1.log" in result.err and "Move them away" in result.err
    assert (out / "tokens-per-s.png").read_text() == "x\n" and (out / "trials" / "trial-1.log").read_text() == "mylog\n"
    assert sorted(p.name for p in out.rglob("*")) == ["tokens-per-s.png", "trial-1.log", "trials"]


@pytest.mark.slow
def test_gpus_2_runs_the_trial_under_the_launcher(cli, tmp_path):
    """--gpus 2 on CPU: the trial is two gloo processes started by torchrun (DeepSpeed ZeRO, as train picks)."""
    result = cli("bench", "--model", "tiny-llama", "--seq-len", "256", "--gpus", "2", "--warmup", "0", "--steps", "1",
                 "--output-dir", tmp_path / "b")
    assert result.code == 0, result.err + result.out
    m = json.loads((tmp_path / "b" / "bench.json").read_text())["measurements"][0]
    assert m["outcome"] == "ok", m.get("error")
    assert m["processes"] == 2 and m["world_size"] == 2 and m["tokens_per_step"] == 2 * 256
    assert "ZeRO" in m["estimate"]["engine"]


def test_a_bench_stopped_by_sigterm_keeps_its_finished_trials_and_leaves_no_trial_running(tmp_path):
    """SIGTERM once the first trial has finished: exit 130 with one message, bench.json and bench.md holding that
    trial and a note of the interruption, and the trial that was running killed (it would hold the GPU)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from lstune.bench.runner import descendants
    from tests.integration.conftest import REPO

    out = tmp_path / "bench"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "lstune", "bench", "--model", "tiny-llama", "--rungs", "hf",
                             "--lengths", "256,32k", "--warmup", "0", "--steps", "1", "--output-dir", str(out)],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 240
    while not (out / "trials" / "trial-1.json").exists() or not (out / "trials" / "trial-2.log").exists():
        assert time.time() < deadline and proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    running = descendants(proc.pid)
    proc.send_signal(signal.SIGTERM)
    # Not waiting for the 32K trial: a trial left running would keep the output pipe open for a minute or more.
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130, err
    assert "SIGTERM received: bench stopped; its 1 finished trial(s) are in" in err and "Traceback" not in err
    bench = json.loads((out / "bench.json").read_text())
    assert [t["id"] for t in bench["trials"]] == [1] and bench["trials"][0]["outcome"] == "ok"
    assert any("Interrupted (SIGTERM) during trial 2" in note for note in bench["notes"])
    assert "Interrupted (SIGTERM)" in (out / "bench.md").read_text()
    # Every process the bench had started ends within seconds: the trial is killed and waited for; the forkserver
    # that forked it exits with the bench, tearing its memory down for a moment (state R, no command line). A trial
    # left running would go on for minutes (the 32K trial).
    deadline = time.time() + 15
    for pid in running:
        while (state := _process_state(pid)) not in (None, "Z") and time.time() < deadline:
            time.sleep(0.1)
        assert state in (None, "Z"), f"process {pid} still running (state {state})"
    assert not (out / "trials" / "trial-2.json").exists()  # what a trial that ran on to its end would have written


def _process_state(pid: int) -> str | None:
    """The state letter of a process (/proc), None when it has gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None
