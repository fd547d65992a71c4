"""`lstune recipes`: the recipes shipped with lstune, each usable by name with --config."""

from __future__ import annotations

import typer

from lstune.cli.help import HelpCommand

HELP = ("List the recipes shipped with lstune: each one's name (give it to --config, e.g. lstune train --config "
        "tiny-llama/4k-cpu-demo), its model, length and processes, and the first line of its comment block.")


def register(app: typer.Typer) -> None:
    app.command("recipes", help=HELP, cls=HelpCommand)(_recipes_command)


def _recipes_command() -> None:
    from rich.table import Table

    from lstune.cli.render import console
    from lstune.config.load import build_config, read_recipe, shipped_recipes

    table = Table(show_lines=False)
    for column in ("recipe", "model", "seq len", "gpus", "what it is"):
        table.add_column(column, no_wrap=column != "what it is")
    for name, path in shipped_recipes().items():
        config = build_config(read_recipe(path), recipe_name=str(path))
        title = next((line.lstrip("# ").strip() for line in path.read_text().splitlines() if line.startswith("#")), "")
        table.add_row(name, config.model.name, str(read_recipe(path).get("seq_len", "")), str(config.parallel.gpus),
                      title)
    console().print(table)
    console().print("Run one: lstune train --config NAME [flags]; see one: lstune train --config NAME --dry-run",
                    markup=False)
