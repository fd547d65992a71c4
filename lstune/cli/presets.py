"""`lstune presets`: the model presets shipped with lstune."""

from __future__ import annotations

import typer

from lstune.cli.help import HelpCommand


def register(app: typer.Typer) -> None:
    app.command("presets", cls=HelpCommand, help="List the model presets (configs shipped with lstune; random-initialised).")(
        _presets_command
    )


def _presets_command() -> None:
    from rich.table import Table

    from lstune.cli.render import console
    from lstune.models.presets import list_presets

    table = Table()
    for column in ("preset", "architecture", "layers", "hidden", "heads q/kv", "vocab", "real model"):
        table.add_column(column, no_wrap=True)
    for name, preset in list_presets().items():
        c = preset.config
        q = c.get("num_attention_heads")  # none in an attention-free model (tiny-mamba, tiny-mamba2)
        heads = f"{q}/{c.get('num_key_value_heads', q)}" if q else "-"
        table.add_row(
            name, c["model_type"], str(c["num_hidden_layers"]), str(c["hidden_size"]), heads,
            str(c["vocab_size"]), preset.hub_id or "-",
        )
    console().print(table)
