"""`--help` that fits a terminal: every flag name whole, switches without a metavar, one flag in a few lines.

Typer's rich help puts each option in a four-column table (flag, `--no-` flag, metavar, help); at 80
columns the long flag names are cut (`--offload-checkpoi…`) and the help column shrinks to a few words a
line. `HelpCommand` replaces that layout for lstune's commands with plain text grouped by the same panels:
at 100 columns and more, flag and help side by side (the help below a flag too long for its column); under
100, the help under its flag, indented. The width is the terminal's (`COLUMNS` when set), capped at 120.
"""

from __future__ import annotations

import shutil
import textwrap

from typer.core import TyperCommand, TyperGroup

SIDE_BY_SIDE = 100  # columns from which flag and help sit side by side
FLAG_COLUMN = 34  # the flag column's width when they do
STACKED_INDENT = 6


def help_width() -> int:
    return max(60, min(shutil.get_terminal_size((80, 24)).columns, 120))


def _is_option(param) -> bool:
    # Duck-typed: typer >= 0.2x has its own copy of click, whose classes are not click's.
    return getattr(param, "param_type_name", None) == "option" and not getattr(param, "hidden", False)


def option_names(param) -> str:
    """`--x / --no-x` for a switch, `--x METAVAR` for an option with a value, `-c, --config PATH`."""
    names = ", ".join(sorted(param.opts, key=len))
    if param.secondary_opts:
        names += " / " + ", ".join(param.secondary_opts)
    if getattr(param, "is_flag", False):
        return names
    metavar = param.metavar or (param.name or "value").upper()
    return f"{names} {metavar}"


def format_options(params: list, width: int) -> list[str]:
    """The help lines of these options under their panel titles (`rich_help_panel`, else 'Options')."""
    panels: dict[str, list] = {}
    for param in params:
        if _is_option(param):
            panels.setdefault(getattr(param, "rich_help_panel", None) or "Options", []).append(param)
    lines: list[str] = []
    for title, members in panels.items():
        lines += ["", f"{title}:"]
        for param in members:
            # Typer renders help as rich markup, so cli.options escapes "[default: 4k]" as "\\[default: 4k]".
            lines += _option_lines(option_names(param), (param.help or "").replace("\\[", "["), width)
    return lines


def _option_lines(names: str, text: str, width: int) -> list[str]:
    if width >= SIDE_BY_SIDE:
        column = FLAG_COLUMN
        body = _wrap(text, width - column - 2) or [""]
        if len(names) + 4 <= column:
            return [f"  {names:<{column - 2}}{body[0]}", *(" " * column + line for line in body[1:])]
        return [f"  {names}", *(" " * column + line for line in body if line)]
    wrapped = _wrap(text, width - STACKED_INDENT)
    return [f"  {names}", *(" " * STACKED_INDENT + line for line in wrapped)]


def _head(command, ctx, usage: str, width: int) -> list[str]:
    lines = [f"Usage: {ctx.command_path} {usage}", ""]
    for paragraph in (command.help or "").split("\n\n"):
        lines += _wrap(" ".join(paragraph.split()), width - 2, initial_indent="  ", subsequent_indent="  ") + [""]
    return lines


class HelpCommand(TyperCommand):
    """A Typer command whose `--help` is laid out by `format_options` (see the module doc)."""

    def format_help(self, ctx, formatter) -> None:
        width = help_width()
        lines = _head(self, ctx, "[OPTIONS]", width) + format_options(self.get_params(ctx), width)[1:]
        formatter.write("\n".join(lines) + "\n")


class HelpGroup(TyperGroup):
    """`lstune --help` in the same layout: the global options, then each command with its first sentence."""

    def format_help(self, ctx, formatter) -> None:
        width = help_width()
        lines = _head(self, ctx, "[OPTIONS] COMMAND [ARGS]...", width) + format_options(self.get_params(ctx), width)[1:]
        commands = [(name, self.get_command(ctx, name)) for name in self.list_commands(ctx)]
        commands = [(name, command) for name, command in commands if command is not None and not command.hidden]
        column = max(len(name) for name, _ in commands) + 4
        lines += ["", "Commands:"]
        for name, command in commands:
            body = _wrap(" ".join((command.help or "").split("\n\n")[0].split()), width - column - 2) or [""]
            lines += [f"  {name:<{column - 2}}{body[0]}", *(" " * column + line for line in body[1:])]
        formatter.write("\n".join(lines) + "\n")


def _wrap(text: str, width: int, **kwargs) -> list[str]:
    """Wrapped at spaces only: flag names and paths (`--seq-len`, `4k-cpu-demo.yaml`) stay whole."""
    return textwrap.wrap(text, width, break_on_hyphens=False, break_long_words=False, **kwargs)
