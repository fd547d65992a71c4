"""`lstune train`: parse flags (built from the config sections' fields), validate, run, render."""

from __future__ import annotations

import inspect
from typing import Any

import typer

from lstune.cli.help import HelpCommand

from lstune.cli.options import config_parameter, given_flags, section_parameters, to_argv

HELP = (
    "Fine-tune a causal LM on long sequences.\n\n"
    "Flags override the recipe given with --config; every config problem is reported at once, before any "
    "model or data is loaded. The demo: lstune train --config tiny-llama/4k-cpu-demo."
)


def register(app: typer.Typer) -> None:
    command = _train_command
    command.__signature__ = _signature()
    app.command("train", help=HELP, no_args_is_help=False, cls=HelpCommand)(command)


def _signature() -> inspect.Signature:
    dry_run = inspect.Parameter(
        "dry_run", inspect.Parameter.KEYWORD_ONLY, annotation=bool,
        default=typer.Option(False, "--dry-run", help=(
            "Check the config as the run would, print its plan here (every `auto` resolved, predicted peaks, "
            "verdict) and exit; loads no weights, writes nothing.")),
    )
    ctx = inspect.Parameter("ctx", inspect.Parameter.KEYWORD_ONLY, annotation=typer.Context)
    return inspect.Signature([ctx, config_parameter(), dry_run, *section_parameters()])


def _train_command(**kwargs: Any) -> int:
    from lstune.cli.render import RichReporter, console, print_summary
    from lstune.config.load import build_config, read_recipe
    from lstune.train.preflight import preflight_problems

    ctx = kwargs.pop("ctx")
    config_path = kwargs.pop("config")
    dry_run = kwargs.pop("dry_run")
    flags = given_flags(kwargs)
    recipe = read_recipe(config_path) if config_path else {}
    name = str(config_path) if config_path else "the recipe"
    config = build_config(recipe, flags, recipe_name=name, checks=lambda c: _data_given(c) + c.training_problems() + preflight_problems(c))
    if dry_run:
        return _dry_run(config)
    if _needs_launch(config):
        from lstune.parallel.launch import relaunch

        refuse(model_problems(config))  # before N processes start, each to refuse the same
        argv = _relaunch_argv(ctx, flags, config_path)
        return relaunch(argv, config.parallel.gpus, config.parallel.hostfile, force=config.run.force)

    from lstune.parallel.comm import close_process_group
    from lstune.train.run import train

    result = train(config, RichReporter(console(), log_every=config.run.log_every))
    if result.is_main:
        print_summary(result)
    close_process_group()  # every rank got here: end the group before the process exits (lstune.parallel.comm)
    return 130 if result.interrupted else 0


MISSING_DATA = (
    "--data is required: a JSONL/JSON/Parquet/Arrow file or folder, a save_to_disk folder or a hub dataset (or "
    "builtin:passkey, the bundled synthetic task: lstune train --config recipes/tiny-llama/4k-cpu-demo.yaml)."
)


def refuse(problems: list[str]) -> None:
    from lstune.errors import ConfigError

    if problems:
        raise ConfigError(problems)


def model_problems(config, *, device: str | None = None) -> list[str]:
    """What a run refuses from the config and the model's config alone, before any weight or data loads
    (lstune.train.plan.refusals: the model resolving, the process layout, attention support, --rope-scaling,
    4-bit weights a random init does not have; a --resume's checkpoint of another model or parallel layout).
    `device` ("cuda"/"cpu") is where the run will train; None: cuda
    when available. Reads the model's config (imports transformers): run it after the cheap checks pass."""
    from lstune.train.plan import refusals

    return refusals(config, device)


def _dry_run(config) -> int:
    """The run's plan on this machine, resolved (lstune.train.plan), with the estimate's verdict — before any
    weights load. A verdict of "does not fit" is printed, not refused: a recipe is often checked on another machine
    than the one it will train on (`lstune estimate --gpu ...` answers for that one)."""
    from lstune.cli.render import print_plan
    from lstune.train.plan import local_plan

    print_plan(local_plan(config))
    return 0


def _data_given(config) -> list[str]:
    """No silent default: a run without --data (or `data:` in its recipe) would train on something not asked for."""
    return [MISSING_DATA] if config.data.source is None else []


def _relaunch_argv(ctx: typer.Context, flags: dict[str, Any], config_path) -> list[str]:
    """This command again, as each launched process runs it (with this one's --debug and --log-level)."""
    root = ctx.find_root().params
    front = ["--debug"] if root.get("debug", False) else []
    if root.get("log_level"):
        front += ["--log-level", root["log_level"]]
    return front + ["train", *to_argv(flags, config_path)]


def _needs_launch(config) -> bool:
    """--gpus N / --hostfile outside a launcher: start the processes (they run this same command)."""
    from lstune.parallel.launch import detect_launch_env

    parallel = config.parallel
    return (parallel.gpus > 1 or parallel.hostfile is not None) and detect_launch_env() is None
