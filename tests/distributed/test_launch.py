"""`relaunch` starts N gloo CPU processes through torchrun; each detects its rank and joins the group."""

from __future__ import annotations

import json

from lstune.parallel.launch import relaunch


def test_relaunch_runs_every_rank_with_the_same_argv(tmp_path):
    code = relaunch([str(tmp_path), "train", "--gpus", "2"], 2, module="tests.distributed._launch_probe")
    assert code == 0
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for rank, report in enumerate(reports):
        assert report == {"rank": rank, "world": 2, "launcher": "torchrun", "backend": "gloo", "sum": 1.0,
                          "argv": ["train", "--gpus", "2"]}


def test_relaunch_returns_the_failing_exit_code(tmp_path):
    assert relaunch([str(tmp_path), "--fail"], 2, module="tests.distributed._launch_probe") != 0


def test_a_folder_named_lstune_in_the_working_directory_is_not_imported(tmp_path, monkeypatch):
    """The processes import the lstune this one runs, whatever the user's working directory holds."""
    shadow = tmp_path / "cwd" / "lstune"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('the user folder named lstune was imported')\n")
    monkeypatch.chdir(tmp_path / "cwd")
    code = relaunch([str(tmp_path), "train"], 2, module="tests.distributed._launch_probe")
    assert code == 0
    assert all((tmp_path / f"rank{r}.json").is_file() for r in range(2))
