"""The `lstune` command: a Typer app with one thin module per command.

User mistakes (lstune.errors.UserError) print one message and exit with code 2; `--debug` adds the
traceback. Heavy libraries are imported by the commands' work, never here, so `--help` is instant.
"""

from __future__ import annotations

import sys
import traceback

import typer

from lstune import __version__
from lstune.errors import UserError

app = typer.Typer(
    name="lstune",
    help="Fine-tune Hugging Face causal LMs on very long sequences.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"lstune {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version."),
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks for errors."),
) -> None:
    """Fine-tune Hugging Face causal LMs on very long sequences."""


def _register_commands() -> None:
    from lstune.cli import presets, train

    train.register(app)
    presets.register(app)


_register_commands()


def _normalise_resume(argv: list[str]) -> list[str]:
    """`--resume` alone means `--resume latest` (click has no optional option values)."""
    out = []
    for i, arg in enumerate(argv):
        out.append(arg)
        if arg == "--resume" and (i + 1 == len(argv) or argv[i + 1].startswith("-")):
            out.append("latest")
    return out


def main(argv: list[str] | None = None) -> None:
    import click

    args = _normalise_resume(list(sys.argv[1:] if argv is None else argv))
    debug = "--debug" in args
    if debug:  # accepted anywhere on the line: `lstune train ... --debug` as well as `lstune --debug train`
        args = ["--debug"] + [a for a in args if a != "--debug"]
    try:
        code = app(args=args, prog_name="lstune", standalone_mode=False)
    except UserError as exc:
        if debug:
            traceback.print_exc()
        typer.echo(f"lstune: {exc}", err=True)
        sys.exit(exc.exit_code)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except (click.exceptions.Abort, KeyboardInterrupt):
        typer.echo("lstune: interrupted", err=True)
        sys.exit(130)
    sys.exit(code if isinstance(code, int) else 0)
