"""--report-to through the real CLI: every step's metrics and the config reach each tracker; a missing package
is a config error naming the extra to install. The trackers are fakes injected in sys.modules (tensorboard,
wandb and mlflow are optional extras not installed for the tests; nothing touches the network)."""

from __future__ import annotations

import importlib.machinery
import sys
import types

import pytest

from tests.integration.conftest import TINY_MODEL, read_metrics


def _module(name: str, **attrs) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)
    module.__dict__.update(attrs)
    return module


@pytest.fixture
def fake_trackers(monkeypatch):
    seen = {"tensorboard": [], "wandb": [], "mlflow": [], "closed": []}

    class SummaryWriter:
        def __init__(self, log_dir):
            seen["tb_dir"] = log_dir

        def add_text(self, tag, text):
            seen["tb_config"] = text

        def add_scalar(self, key, value, step):
            seen["tensorboard"].append((step, key, value))

        def flush(self):
            pass

        def close(self):
            seen["closed"].append("tensorboard")

    class Run:
        def log(self, values, step):
            seen["wandb"].append((step, values))

        def finish(self):
            seen["closed"].append("wandb")

    def init(**kwargs):
        seen["wandb_init"] = kwargs
        return Run()

    mlflow = _module(
        "mlflow", set_tracking_uri=lambda uri: seen.setdefault("mlflow_uri", uri),
        start_run=lambda run_name: seen.setdefault("mlflow_run", run_name),
        log_params=lambda params: seen.setdefault("mlflow_params", params),
        log_metrics=lambda values, step: seen["mlflow"].append((step, values)),
        end_run=lambda: seen["closed"].append("mlflow"),
    )
    monkeypatch.setitem(sys.modules, "tensorboard", _module("tensorboard"))
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", _module("torch.utils.tensorboard", SummaryWriter=SummaryWriter))
    monkeypatch.setitem(sys.modules, "wandb", _module("wandb", init=init))
    monkeypatch.setitem(sys.modules, "mlflow", mlflow)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    return seen


def test_every_metric_and_the_config_reach_each_tracker(cli, tmp_path, text_data, fake_trackers):
    out = tmp_path / "run"
    result = cli("train", *TINY_MODEL, "--data", text_data, "--max-steps", "2", "--eval-split", "0.2",
                 "--report-to", "tensorboard,wandb,mlflow", "--output-dir", out)
    assert result.code == 0, result.err
    seen, metrics = fake_trackers, read_metrics(out)
    assert seen["tb_dir"] == str(out / "tensorboard") and "seq_len: 256" in seen["tb_config"]
    assert {(s, k) for s, k, _ in seen["tensorboard"]} >= {(2, "loss"), (2, "eval_loss"), (1, "tokens_per_s")}
    assert ("loss", metrics[1]["loss"]) in [(k, v) for s, k, v in seen["tensorboard"] if s == 2]
    assert seen["wandb_init"]["mode"] == "offline" and seen["wandb_init"]["dir"] == str(out)
    assert seen["wandb_init"]["config"]["seq_len"] == 256
    assert [s for s, _ in seen["wandb"]] == [1, 2] and seen["wandb"][1][1]["eval_loss"] == metrics[1]["eval_loss"]
    assert seen["mlflow_uri"] == (out / "mlruns").resolve().as_uri() and seen["mlflow_params"]["lr"] == "0.001"
    assert [s for s, _ in seen["mlflow"]] == [1, 2]
    assert sorted(seen["closed"]) == ["mlflow", "tensorboard", "wandb"]


def test_a_missing_tracker_package_is_a_config_error(cli, tmp_path, text_data, monkeypatch):
    monkeypatch.setitem(sys.modules, "mlflow", None)  # import fails: as if not installed
    result = cli("train", *TINY_MODEL, "--data", text_data, "--report-to", "mlflow", "--output-dir", tmp_path / "o")
    assert result.code == 2 and "Traceback" not in result.err
    assert "pip install 'lstune[mlflow]'" in result.err
    result = cli("train", *TINY_MODEL, "--data", text_data, "--report-to", "tensorbored", "--dry-run")
    assert result.code == 2 and "tensorboard, wandb, mlflow or none" in result.err
