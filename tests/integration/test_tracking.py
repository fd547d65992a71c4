"""--report-to through the real CLI with the real packages (in the `test` extra): what each tracker stored is read
back with its own reader and equals metrics.jsonl, with the run's config. W&B runs offline (nothing touches the
network); MLflow writes a file store in OUTPUT_DIR. A missing package is a config error naming the extra."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.integration.conftest import TINY_MODEL, read_metrics

STEPS = 3


def _train(cli, tmp_path, text_data, tracker: str) -> tuple[Path, list[dict]]:
    out = tmp_path / "run"
    result = cli("train", *TINY_MODEL, "--data", text_data, "--max-steps", STEPS, "--eval-split", "0.2",
                 "--eval-every", "2", "--report-to", tracker, "--output-dir", out)
    assert result.code == 0, result.err
    return out, read_metrics(out)


def _scalars(metrics: list[dict]) -> dict[str, dict[int, float]]:
    """key -> {step: value} of the numeric metrics (what lstune.train.tracking sends)."""
    table: dict[str, dict[int, float]] = {}
    for record in metrics:
        for key, value in record.items():
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                table.setdefault(key, {})[record["step"]] = float(value)
    return table


def test_tensorboard_event_files_hold_every_metric_of_metrics_jsonl(cli, tmp_path, text_data):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, metrics = _train(cli, tmp_path, text_data, "tensorboard")
    events = EventAccumulator(str(out / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    expected = _scalars(metrics)
    assert set(events.Tags()["scalars"]) == set(expected)
    for key, by_step in expected.items():
        # TensorBoard stores scalars as float32.
        assert {e.step: e.value for e in events.Scalars(key)} == {s: float(np.float32(v)) for s, v in by_step.items()}, key
    assert sorted(expected["eval_loss"]) == [2, 3] and sorted(expected["loss"]) == [1, 2, 3]
    config = events.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "seq_len: 256" in config and "report_to:\n- tensorboard" in config


def wandb_records(path: Path) -> list:
    """The protobuf records of an offline run's `run-ID.wandb` file (what `wandb sync` uploads): a file header
    (":W&B", magic, version), then LevelDB-log records in 32 KiB blocks — crc32c, length, type (1 full, 2 first,
    3 middle, 4 last) — a block's tail too short for a header being padding."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, chunk, records = 7, 32768, b"", []
    while pos + 7 <= len(data):
        room = block - pos % block
        if room < 7:
            pos += room
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        chunk += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunk)
            records.append(record)
            chunk = b""
    return records


def test_wandb_runs_offline_and_its_run_file_holds_the_config_and_every_metric(cli, tmp_path, text_data, monkeypatch):
    for name in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_PROJECT", "WANDB_DIR"):
        monkeypatch.delenv(name, raising=False)
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):  # nothing written in the home folder
        monkeypatch.setenv(name, str(tmp_path / name.lower()))
    out, metrics = _train(cli, tmp_path, text_data, "wandb")
    runs = sorted((out / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, "W&B did not run offline"
    records = wandb_records(next(runs[0].glob("run-*.wandb")))
    by_type: dict[str, list] = {}
    for record in records:
        by_type.setdefault(record.WhichOneof("record_type"), []).append(record)
    run = by_type["run"][0].run
    assert run.project == "lstune" and run.display_name == "run"
    config = {item.key: json.loads(item.value_json) for item in run.config.update}
    assert config["seq_len"] == 256 and config["report_to"] == ["wandb"]
    history = {}
    for record in by_type["history"]:
        items = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
        history[record.history.step.num] = {k: v for k, v in items.items() if not k.startswith("_")}
    assert history == {m["step"]: {k: float(v) for k, v in m.items() if k != "step" and not isinstance(v, bool)}
                       for m in metrics}
    assert "exit" in by_type, "the run was not finished"


def test_mlflow_file_store_in_the_output_dir_holds_the_config_and_every_metric(cli, tmp_path, text_data, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "")  # recorded, so that the delenv below is undone after the test
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE")  # MLflow 3 refuses a file store without it: lstune opts in
    out, metrics = _train(cli, tmp_path, text_data, "mlflow")
    client = MlflowClient(tracking_uri=(out / "mlruns").resolve().as_uri())
    [run] = client.search_runs(experiment_ids=["0"])
    assert run.info.run_name == "run" and run.info.status == "FINISHED"
    assert run.data.params["seq_len"] == "256" and run.data.params["lr"] == "0.001"
    for key, by_step in _scalars(metrics).items():
        history = client.get_metric_history(run.info.run_id, key)
        assert {m.step: m.value for m in history} == by_step, key


def test_a_tracker_that_cannot_start_is_a_user_error(cli, tmp_path, text_data, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "nosuchscheme://nowhere")
    result = cli("train", *TINY_MODEL, "--data", text_data, "--max-steps", "1", "--report-to", "mlflow",
                 "--output-dir", tmp_path / "o")
    assert result.code == 2 and "Traceback" not in result.err
    assert "--report-to mlflow could not start" in result.err and "nosuchscheme" in result.err


def test_a_missing_tracker_package_is_a_config_error(cli, tmp_path, text_data, monkeypatch):
    monkeypatch.setitem(sys.modules, "mlflow", None)  # import fails: as if not installed
    result = cli("train", *TINY_MODEL, "--data", text_data, "--report-to", "mlflow", "--output-dir", tmp_path / "o")
    assert result.code == 2 and "Traceback" not in result.err
    assert "pip install 'lstune[mlflow]'" in result.err
    result = cli("train", *TINY_MODEL, "--data", text_data, "--report-to", "tensorbored", "--dry-run")
    assert result.code == 2 and "tensorboard, wandb, mlflow or none" in result.err


def test_an_unreachable_mlflow_server_is_refused_at_once(cli, tmp_path, text_data, monkeypatch):
    import socket
    import time

    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{port}")
    started = time.monotonic()
    result = cli("train", *TINY_MODEL, "--data", text_data, "--max-steps", "1", "--report-to", "mlflow",
                 "--output-dir", tmp_path / "o")
    assert time.monotonic() - started < 60  # MLflow's own retries take ~5 minutes
    assert result.code == 2 and "Traceback" not in result.err
    assert f"the tracking server http://127.0.0.1:{port} cannot be reached (Connection refused)" in result.err
