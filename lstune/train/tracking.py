"""Experiment tracking (`--report-to tensorboard,wandb,mlflow`): the run's config once, every step's metrics.

Each tracker is an optional extra (`pip install lstune[tensorboard]`, `[wandb]`, `[mlflow]`), imported only
when asked for; `missing_trackers` names the missing package before anything heavy loads. Where they write:
TensorBoard event files in OUTPUT_DIR/tensorboard; W&B in OUTPUT_DIR/wandb, offline unless WANDB_MODE or
WANDB_API_KEY says otherwise (so a job without network still records its run; `wandb sync` uploads it);
MLflow to MLFLOW_TRACKING_URI, or a file store in OUTPUT_DIR/mlruns. Only the main process reports.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

# tracker -> (module that must import, pip extra, folder it writes in OUTPUT_DIR)
TRACKERS = {
    "tensorboard": ("tensorboard", "tensorboard", "tensorboard"),
    "wandb": ("wandb", "wandb", "wandb"),
    "mlflow": ("mlflow", "mlflow", "mlruns"),
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
        try:
            for name in names:
                getattr(self, f"_start_{name}")(Path(output_dir), config)
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
        import mlflow

        if "MLFLOW_TRACKING_URI" not in os.environ:
            mlflow.set_tracking_uri((output_dir / "mlruns").resolve().as_uri())
        mlflow.start_run(run_name=output_dir.name)
        # MLflow params are strings of bounded length.
        mlflow.log_params({k: str(v)[:500] for k, v in config.items()})
        self._loggers.append(lambda values, step: mlflow.log_metrics(values, step=step))
        self._closers.append(mlflow.end_run)
