"""`--help` at the widths people use: every flag name whole, no metavar on a switch, a flag in a few lines."""

from __future__ import annotations

import re

import pytest

from lstune.cli.app import main
from lstune.config.schema import FLAT_FIELDS, flag_name


def _help(command: str, width: int, monkeypatch, capsys) -> str:
    monkeypatch.setenv("COLUMNS", str(width))
    with pytest.raises(SystemExit) as exit_:
        main([command, "--help"])
    assert exit_.value.code == 0
    return capsys.readouterr().out


def _blocks(text: str) -> dict[str, list[str]]:
    """Each option's lines, keyed by its first flag (a block starts at a line indented by two spaces and a dash)."""
    blocks: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        match = re.match(r"  (-\w, )?(--[\w-]+)", line)
        if match:
            current = match.group(2)
            blocks[current] = [line]
        elif current and line.startswith("      "):
            blocks[current].append(line)
        else:
            current = None
    return blocks


@pytest.mark.parametrize("width", [80, 100])
@pytest.mark.parametrize("command", ["train", "bench", "estimate"])
def test_help_fits_the_width_and_names_every_flag_whole(command, width, monkeypatch, capsys):
    text = _help(command, width, monkeypatch, capsys)
    too_long = [line for line in text.splitlines() if len(line) > width]
    assert not too_long, too_long
    assert "…" not in text and "<bool>" not in text
    blocks = _blocks(text)
    if command == "train":
        assert set(blocks) >= {flag_name(key) for key in FLAT_FIELDS}, set(map(flag_name, FLAT_FIELDS)) - set(blocks)



@pytest.mark.parametrize("width", [80, 100])
def test_switches_show_both_names_and_no_metavar(width, monkeypatch, capsys):
    blocks = _blocks(_help("train", width, monkeypatch, capsys))
    assert blocks["--pack"][0].split()[:3] == ["--pack", "/", "--no-pack"]
    assert blocks["--dry-run"][0].split()[:2] == (["--dry-run"] if width < 100 else ["--dry-run", "Check"])
    assert blocks["--seq-len"][0].split()[:2] == ["--seq-len", "LENGTH"]
    assert blocks["--offload-checkpoints"][0].split()[:3] == ["--offload-checkpoints", "/", "--no-offload-checkpoints"]


def test_help_is_under_300_lines_at_80_columns(monkeypatch, capsys):
    """Issue 38 found 487 lines at 80 columns (a four-column table squeezing the help into a few words a line)."""
    assert len(_help("train", 80, monkeypatch, capsys).splitlines()) < 300


@pytest.mark.parametrize("width", [80, 100])
def test_root_help_lists_every_command_within_the_width(width, monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", str(width))
    with pytest.raises(SystemExit):
        main(["--help"])
    text = capsys.readouterr().out
    assert all(len(line) <= width for line in text.splitlines())
    assert "<bool>" not in text and "--log-level LEVEL" in text
    for command in ("train", "estimate", "data", "presets", "recipes", "plot", "bench"):
        assert re.search(rf"^  {command} +\S", text, re.M), command


MAX_OPTION_LINES = 4  # a flag's line and its help: the detail lives in the docs the help points to


def _commands(monkeypatch, capsys) -> list[str]:
    monkeypatch.setenv("COLUMNS", "80")
    with pytest.raises(SystemExit):
        main(["--help"])
    listing = capsys.readouterr().out.split("Commands:", 1)[1]
    return re.findall(r"^  (\w[\w-]*) ", listing, re.M)


@pytest.mark.parametrize("width", [80, 100])
def test_every_option_of_every_command_takes_at_most_four_lines(width, monkeypatch, capsys):
    """Issue 38: `--offload-checkpoints`, `--attn-chunks` and `--offload-ratio` took 7 lines at 80 columns."""
    commands = _commands(monkeypatch, capsys)
    assert {"train", "estimate", "bench", "data", "recipes", "presets", "plot"} <= set(commands)
    too_tall = {}
    for command in commands:
        blocks = _blocks(_help(command, width, monkeypatch, capsys))
        assert "--help" in blocks, command
        too_tall.update({f"{command} {flag}": len(lines) for flag, lines in blocks.items()
                         if len(lines) > MAX_OPTION_LINES})
    assert not too_tall, too_tall
