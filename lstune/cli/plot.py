"""`lstune plot OUTPUT_DIR`: draw a run's metrics.jsonl (loss, validation loss, tokens/s, memory) as a PNG."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from lstune.cli.help import HelpCommand
from rich.markup import escape

HELP = (
    "Plot a run's metrics: loss and validation loss vs step and tokens, tokens/s, peak memory. Works while the "
    "run goes on. Writes OUTPUT_DIR/metrics.png unless --out names another file."
)


def register(app: typer.Typer) -> None:
    app.command("plot", help=HELP, cls=HelpCommand)(plot)


def plot(
    output_dir: Path = typer.Argument(..., help="The run's --output-dir (holding metrics.jsonl)."),
    # Escaped: typer renders help as rich markup, which would swallow "[default: ...]" (lstune.cli.options).
    out: Optional[Path] = typer.Option(
        None, "--out", help=escape("The PNG to write [default: OUTPUT_DIR/metrics.png].")
    ),
) -> int:
    from lstune.train.plots import plot_run

    path = plot_run(output_dir, out)
    typer.echo(f"plot written: {path}")
    return 0
