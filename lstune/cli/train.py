"""`lstune train`: parse flags (built from TrainConfig's fields), validate, run, render."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any, Optional

import typer

from lstune.config import parse
from lstune.config.schema import config_fields, field_default

HELP = (
    "Fine-tune a causal LM on long sequences.\n\n"
    "Flags override the recipe given with --config; every config problem is reported at once, before any "
    "model or data is loaded. Defaults train the embedded demo: the tiny-llama preset on bundled passkey data."
)


def register(app: typer.Typer) -> None:
    command = _train_command
    command.__signature__ = _signature()
    app.command("train", help=HELP, no_args_is_help=False)(command)


def _signature() -> inspect.Signature:
    params = [
        _param("config", Optional[Path], typer.Option(None, "--config", "-c", help="A YAML recipe (see recipes/).")),
        _param("dry_run", bool, typer.Option(False, "--dry-run", help="Print the resolved config and exit.")),
    ]
    for f in config_fields():
        flag = "--" + f.name.replace("_", "-")
        default = field_default(f)
        shown = parse.format_length(default) if f.name == "seq_len" else default
        help_text = f"{f.metadata['help']} [default: {shown}]"
        if f.metadata["parser"] is parse.parse_bool and f.metadata.get("style") != "value":
            option = typer.Option(None, f"{flag}/--no-{flag[2:]}", help=help_text, rich_help_panel=f.metadata["section"],
                                  show_default=False)
            params.append(_param(f.name, Optional[bool], option))
        else:
            option = typer.Option(None, flag, help=help_text, rich_help_panel=f.metadata["section"], show_default=False,
                                  metavar=_metavar(f.name))
            params.append(_param(f.name, Optional[str], option))
    return inspect.Signature(params)


def _param(name: str, annotation: Any, default: Any) -> inspect.Parameter:
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotation)


def _metavar(name: str) -> str:
    return {
        "seq_len": "LENGTH", "model": "MODEL", "data": "SOURCE", "output_dir": "DIR", "resume": "[PATH]",
        "checkpointing": "on|off", "tiled_mlp": "auto|off|N", "tiled_loss": "auto|off|N", "host_mem_budget": "BYTES",
    }.get(name, "VALUE")


def _train_command(**kwargs: Any) -> int:
    from lstune.cli.render import RichReporter, console, print_config, print_summary
    from lstune.config.load import build_config, read_recipe
    from lstune.train.preflight import preflight_problems

    config_path = kwargs.pop("config")
    dry_run = kwargs.pop("dry_run")
    recipe = read_recipe(config_path) if config_path else {}
    name = str(config_path) if config_path else "the recipe"
    config = build_config(recipe, kwargs, recipe_name=name, checks=preflight_problems)
    if dry_run:
        print_config(config)
        return 0
    if _needs_launch(config):
        from lstune.cli.app import current_argv
        from lstune.parallel.launch import relaunch
        from lstune.train.preflight import check_parallel_layout

        check_parallel_layout(config)
        return relaunch(current_argv(), config.gpus, config.hostfile)

    from lstune.train.run import train

    result = train(config, RichReporter(console(), log_every=config.log_every))
    if result.is_main:
        print_summary(result)
    return 130 if result.interrupted else 0


def _needs_launch(config) -> bool:
    """--gpus N / --hostfile outside a launcher: start the processes (they run this same command)."""
    from lstune.parallel.launch import detect_launch_env

    return (config.gpus > 1 or config.hostfile is not None) and detect_launch_env() is None
