"""Command-line options built from the config's section fields, shared by every command.

A command names the sections it takes (`train` all of them; `estimate` and `bench` the ones they need);
`section_parameters` turns each field into a Typer option — flag, help, default shown, metavar and help
panel all from the field's metadata (lstune.config.schema). Adding a field to a section is therefore one
edit: it appears on every command that uses the section, in recipes and in `--help`.

`to_argv` writes the given options back as arguments, so a command that relaunches itself in N
processes passes its own options on explicitly (no process-global argv).
"""

from __future__ import annotations

import inspect
from dataclasses import fields
from pathlib import Path
from typing import Any, Iterable, Optional

import typer
from rich.markup import escape

from lstune.config import parse
from lstune.config.schema import FLAT_FIELDS, SECTIONS, field_default, flag_name


def _param(name: str, annotation: Any, default: Any) -> inspect.Parameter:
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotation)


def _is_switch(f) -> bool:
    """A `--x/--no-x` switch (an 'auto' field marked `switch` too: not given = auto); fields with style "value"
    take on|off instead (e.g. --checkpointing off)."""
    return (f.metadata["parser"] is parse.parse_bool or f.metadata.get("switch")) and f.metadata.get("style") != "value"


def config_parameter() -> inspect.Parameter:
    text = "A YAML recipe: its path, or the name of one shipped with lstune (`lstune recipes`)."
    return _param("config", Optional[Path], typer.Option(None, "--config", "-c", metavar="RECIPE", help=text))


def section_parameters(sections: Iterable[str] | None = None) -> list[inspect.Parameter]:
    """One keyword parameter per field of the named sections (all when None), in option order."""
    wanted = set(sections) if sections is not None else {name for name, _ in SECTIONS}
    return [field_parameter(key, f, SECTIONS_TITLES[section]) for key, (section, f) in FLAT_FIELDS.items()
            if section in wanted]


def dataclass_parameters(options_type: type) -> list[inspect.Parameter]:
    """One keyword parameter per field of a command's own options dataclass (fields with the sections'
    metadata: help, parser, metavar), under its `title` panel."""
    return [field_parameter(f.name, f, options_type.title) for f in fields(options_type)]


def field_parameter(key: str, f, panel: str) -> inspect.Parameter:
    """The Typer option of one field: flag, help with its default, metavar, help panel from its metadata."""
    default = field_default(f)
    shown = f.metadata["show"](default) if "show" in f.metadata else default
    shown = {True: "on", False: "off"}.get(shown, shown) if isinstance(shown, bool) else shown
    # Escaped: typer renders help as rich markup, which would swallow "[default: 4k]" and "[seq, vocab]".
    # No default (None) is said by the help text itself ("required", "default: one epoch", ...).
    text = f.metadata["help"] if default is None else f"{f.metadata['help']} [default: {shown}]"
    common = dict(help=escape(text), rich_help_panel=panel, show_default=False)
    flag = flag_name(key)
    if _is_switch(f):
        return _param(key, Optional[bool], typer.Option(None, f"{flag}/--no-{flag[2:]}", **common))
    metavar = f.metadata.get("metavar") or _metavar(f.metadata["parser"])
    if f.metadata.get("multiple"):  # repeatable; typer gives [] when absent
        return _param(key, Optional[list[str]], typer.Option(None, flag, metavar=metavar, **common))
    return _param(key, Optional[str], typer.Option(None, flag, metavar=metavar, **common))


def _metavar(parser) -> str:
    """What a value looks like, from the field's parser: its choices, N for a count, F for a number."""
    func, keywords = getattr(parser, "func", parser), getattr(parser, "keywords", {})
    if "choices" in keywords:
        return "|".join(keywords["choices"])
    return {parse.parse_int: "N", parse.parse_float: "F", parse.parse_auto_int: "auto|N"}.get(func, "VALUE")


SECTIONS_TITLES = {name: section_type.title for name, section_type in SECTIONS}


def given_flags(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The config options among a command's keyword arguments (None = not given)."""
    return {key: (value or None) if isinstance(value, list) else value
            for key, value in kwargs.items() if key in FLAT_FIELDS}


def to_argv(flags: dict[str, Any], config_path: Path | None = None) -> list[str]:
    """The arguments that give these options again (None = not given), e.g. for the processes of a relaunch."""
    argv = ["--config", str(config_path)] if config_path is not None else []
    for key, value in flags.items():
        if value is None:
            continue
        section, f = FLAT_FIELDS[key]
        flag = flag_name(key)
        if _is_switch(f):
            argv.append(flag if value else f"--no-{flag[2:]}")
        elif isinstance(value, list):
            argv += [part for item in value for part in (flag, str(item))]
        else:
            argv += [flag, str(value)]
    return argv
