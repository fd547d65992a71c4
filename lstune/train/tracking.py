"""Experiment tracking (`--report-to tensorboard,wandb,mlflow`): the run's config once, every step's metrics.

Each tracker is an optional extra (`pip install lstune[tensorboard]`, `[wandb]`, `[mlflow]`), imported only
when asked for; `missing_trackers` names the missing package before anything heavy loads. Where they write:
TensorBoard event files in OUTPUT_DIR/tensorboard; W&B in OUTPUT_DIR/wandb, offline unless WANDB_MODE or
WANDB_API_KEY says otherwise (so a job without network still records its run; `wandb sync` uploads it);
MLflow to MLFLOW_TRACKING_URI, or a file store in OUTPUT_DIR/mlruns (MLFLOW_EXPERIMENT_NAME picks the experiment).
Only the main process reports; a tracker that cannot start (bad URI, unreachable server) is a UserError.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

from lstune.errors import UserError

# tracker -> (module that must import, pip extra, folder it writes in OUTPUT_DIR)
TRACKERS = {
    "tensorboard": ("tensorboard", "tensorboard", "tensorboard"),
    "wandb": ("wandb", "wandb", "wandb"),
    "mlflow": ("mlflow", "mlflow", "mlruns"),  # the extra installs mlflow-skinny, the logging client
}


def missing_trackers(names: list[str]) -> list[str]:
    """A problem per asked tracker whose package is not installed (found without importing it)."""
    return [
        f"--report-to {name} needs the {module} package: pip install 'lstune[{extra}]' (or drop {name})."
        for name in names
        if name in TRACKERS
        for module, extra, _ in [TRACKERS[name]]
        if importlib.util.find_spec(module) is None
    ]


def folders(names: list[str]) -> list[str]:
    """The OUTPUT_DIR entries the trackers write (claimed as lstune's before they are created)."""
    return [TRACKERS[name][2] for name in names if name in TRACKERS]


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """The numeric metrics of a step record (booleans and the step itself excluded)."""
    return {k: float(v) for k, v in record.items()
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}


class Trackers:
    """The asked trackers behind one interface: `log(record)` per step, `close()` at the end."""

    def __init__(self, names: list[str], output_dir: Path, config: dict[str, Any]):
        self._closers, self._loggers = [], []
        name = ""
        try:
            for name in names:
                getattr(self, f"_start_{name}")(Path(output_dir), config)
        except UserError:
            self.close()
            raise
        except Exception as exc:
            self.close()
            # A tracker's own refusal (an unreachable server, a bad URI or key) is the user's to fix: its message, no traceback.
            raise UserError(f"--report-to {name} could not start: {type(exc).__name__}: {exc}") from exc
        except BaseException:
            self.close()
            raise

    def log(self, record: dict[str, Any]) -> None:
        values = scalars(record)
        for logger in self._loggers:
            logger(values, int(record["step"]))

    def close(self) -> None:
        for closer in reversed(self._closers):
            closer()
        self._closers = []

    def _start_tensorboard(self, output_dir: Path, config: dict[str, Any]) -> None:
        import yaml
        from torch.utils.tensorboard import SummaryWriter

        writer = SummaryWriter(log_dir=str(output_dir / "tensorboard"))
        writer.add_text("config", "```\n" + yaml.safe_dump(config, sort_keys=False) + "```")

        def log(values, step):
            for key, value in values.items():
                writer.add_scalar(key, value, step)
            writer.flush()

        self._loggers.append(log)
        self._closers.append(writer.close)

    def _start_wandb(self, output_dir: Path, config: dict[str, Any]) -> None:
        import wandb

        offline = "WANDB_MODE" not in os.environ and "WANDB_API_KEY" not in os.environ
        run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "lstune"), name=output_dir.name, dir=str(output_dir),
            config=config, **({"mode": "offline"} if offline else {}),
        )
        self._loggers.append(lambda values, step: run.log(values, step=step))
        self._closers.append(run.finish)

    def _start_mlflow(self, output_dir: Path, config: dict[str, Any]) -> None:
        # A client bound to its URI, not mlflow's fluent API: `mlflow.set_tracking_uri` is process-global and would
        # outlive this run (a later run in the same process would ignore MLFLOW_TRACKING_URI).
        import time

        from mlflow.entities import Metric, Param, RunStatus
        from mlflow.tracking import MlflowClient

        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:
            # MLflow 3 keeps its file store only on this opt-in (it prefers a database, which needs SQLAlchemy, not
            # in mlflow-skinny); a folder in OUTPUT_DIR needs no server and `mlflow ui --backend-store-uri` reads it.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            uri = (output_dir / "mlruns").resolve().as_uri()
        check_server_reachable(uri)
        client = MlflowClient(tracking_uri=uri)
        run_id = client.create_run(_mlflow_experiment(client), run_name=output_dir.name).info.run_id
        # MLflow params are strings of bounded length, at most 100 per call.
        params = [Param(k, str(v)[:500]) for k, v in config.items()]
        for i in range(0, len(params), 100):
            client.log_batch(run_id, params=params[i : i + 100])

        def log(values, step):
            now = int(time.time() * 1000)
            client.log_batch(run_id, metrics=[Metric(k, v, now, step) for k, v in values.items()])

        self._loggers.append(log)
        self._closers.append(lambda: client.set_terminated(run_id, RunStatus.to_string(RunStatus.FINISHED)))


# How long the first contact with a tracking server may take before the run is refused.
CONNECT_TIMEOUT_S = 10.0


def check_server_reachable(uri: str, timeout_s: float = CONNECT_TIMEOUT_S) -> None:
    """UserError at once when an http(s) tracking server cannot be connected to. MLflow's client retries a refused
    or timed-out connection 7 times with a growing backoff (~5 minutes) before its message; one plain connection
    tells the same in at most `timeout_s`. A server that answers is left to the client (its errors are its own)."""
    import socket
    from urllib.parse import urlsplit

    parts = urlsplit(uri)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        socket.create_connection((parts.hostname, port), timeout=timeout_s).close()
    except OSError as exc:
        reason = "no answer within " + f"{timeout_s:g} s" if isinstance(exc, TimeoutError) else (exc.strerror or str(exc))
        raise UserError(f"--report-to mlflow: the tracking server {uri} cannot be reached ({reason}); start it, fix "
                        "MLFLOW_TRACKING_URI, or leave it unset to log to OUTPUT_DIR/mlruns.") from None


def _mlflow_experiment(client) -> str:
    """MLFLOW_EXPERIMENT_NAME's experiment (created if new), else MLflow's default one ("0")."""
    name = os.environ.get("MLFLOW_EXPERIMENT_NAME")
    if not name:
        return "0"
    experiment = client.get_experiment_by_name(name)
    return experiment.experiment_id if experiment is not None else client.create_experiment(name)
