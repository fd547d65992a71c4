"""`lstune data --preview`: what `lstune train` would train on, with the same flags, before loading weights."""

from __future__ import annotations

import inspect
from typing import Any

import typer

from lstune.cli.help import HelpCommand

from lstune.cli.options import config_parameter, given_flags, section_parameters

HELP = (
    "Show what training will see: records, samples and tokens, how many were truncated or skipped, and the first "
    "sample decoded with its loss mask (trained tokens bold, the rest dim and in ⟦ ⟧). Takes the train flags that "
    "shape the data; loads the tokenizer, never the weights."
)


def register(app: typer.Typer) -> None:
    command = _data_command
    command.__signature__ = inspect.Signature([
        config_parameter(),
        inspect.Parameter("preview", inspect.Parameter.KEYWORD_ONLY, annotation=bool,
                          default=typer.Option(True, "--preview/--no-preview", help="Show the first sample.")),
        inspect.Parameter("preview_tokens", inspect.Parameter.KEYWORD_ONLY, annotation=int,
                          default=typer.Option(400, "--preview-tokens", help="Tokens of the first sample to show.")),
        *section_parameters(["model", "data", "optim"]),
    ])
    app.command("data", help=HELP, cls=HelpCommand)(command)


def _data_command(**kwargs: Any) -> int:
    from lstune.cli.render import print_data_preview
    from lstune.cli.train import _data_given
    from lstune.config.load import build_config, read_recipe
    from lstune.train.preflight import preflight_problems
    from lstune.train.preview import preview_data

    config_path = kwargs.pop("config")
    preview, tokens = kwargs.pop("preview"), kwargs.pop("preview_tokens")
    recipe = read_recipe(config_path) if config_path else {}
    config = build_config(recipe, given_flags(kwargs), recipe_name=str(config_path or "the recipe"),
                          checks=lambda c: _data_given(c) + preflight_problems(c, weights=False))
    print_data_preview(preview_data(config, max_tokens=tokens if preview else 0))
    return 0
