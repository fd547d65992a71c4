"""`relaunch` starts N gloo CPU processes through torchrun; each detects its rank and joins the group."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from lstune.parallel.launch import relaunch


def test_relaunch_runs_every_rank_with_the_same_argv(tmp_path):
    code = relaunch([str(tmp_path), "train", "--gpus", "2"], 2, module="tests.distributed._launch_probe")
    assert code == 0
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for rank, report in enumerate(reports):
        assert report == {"rank": rank, "world": 2, "launcher": "torchrun", "backend": "gloo", "sum": 1.0,
                          "argv": ["train", "--gpus", "2"]}


def test_a_refusal_on_one_rank_during_the_steps_stops_both_with_its_exit_code_and_one_message(tmp_path):
    """Rank 0 refuses (exit 2, through the CLI's ending) while rank 1 waits in a collective: the launcher returns the
    refusal's exit code with its message once, rank 1 stops at once and quietly (no traceback, no "SIGTERM
    received"), well before the time limit."""
    code = f"import sys; from lstune.parallel.launch import relaunch; sys.exit(relaunch([], 2, module={_PROBE!r}))"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.count("lstune: rank 0's sample is refused: fix the data.") == 1, proc.stderr[-3000:]
    assert proc.stderr.count("lstune:") == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]


_PROBE = "tests.distributed._refusal_probe"


def test_a_folder_named_lstune_in_the_working_directory_is_not_imported(tmp_path, monkeypatch):
    """The processes import the lstune this one runs, whatever the user's working directory holds."""
    shadow = tmp_path / "cwd" / "lstune"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('the user folder named lstune was imported')\n")
    monkeypatch.chdir(tmp_path / "cwd")
    code = relaunch([str(tmp_path), "train"], 2, module="tests.distributed._launch_probe")
    assert code == 0
    assert all((tmp_path / f"rank{r}.json").is_file() for r in range(2))
