"""Checks that need no model or data loaded: run before anything heavy, every problem reported at once.

The rules about the config's own values live with its sections (`TrainConfig.problems()`); these look
outside it: does the model name resolve, does the data source exist.
"""

from __future__ import annotations

from lstune.config.schema import TrainConfig
from lstune.errors import ConfigError, UserError


def preflight_problems(config: TrainConfig) -> list[str]:
    """Every problem found with the model source and the data source."""
    problems: list[str] = []
    for check in (_check_model, _check_data):
        try:
            check(config)
        except UserError as exc:
            problems.extend(exc.problems)
    return problems


def preflight(config: TrainConfig) -> None:
    problems = preflight_problems(config)
    if problems:
        raise ConfigError(problems)


def _check_model(config: TrainConfig) -> None:
    from lstune.models.loading import resolve_source

    resolve_source(config.model.name)


def _check_data(config: TrainConfig) -> None:
    from lstune.data.sources import check_source

    check_source(config.data.source)


def check_parallel_layout(config: TrainConfig) -> None:
    """Before launching N processes: the SP degree must fit them and the model's heads (ConfigError lists
    the valid degrees). Multi-node runs learn their world size from the hostfile, so only --gpus is checked
    for a single node."""
    from lstune.models.loading import resolve_model
    from lstune.parallel.dims import ParallelDims

    if config.parallel.hostfile is not None:
        return
    spec = resolve_model(config.model.name, trust_remote_code=config.model.trust_remote_code)
    ParallelDims.for_model(config.parallel.gpus, config.parallel.sp, spec.config)
