"""docs/extension.md lists every edit an extension needs, file by file: each file it names exists and holds each
name it lists, so a rename or a move that forgets the page fails here."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "extension.md"
SECTIONS = ("A new memory technique", "A new attention backend", "A new token mixer", "A new CLI flag")
# "- `path` — `name`: ...; `other`: ..." — the file, then the names the line tells to edit in it.
LINE = re.compile(r"^- `(?P<path>[^`]+)` — (?P<rest>.*)$")


def _entries() -> list[tuple[str, str, list[str]]]:
    """(section, path, names) for every listed line."""
    entries, section = [], None
    for line in DOC.read_text().splitlines():
        if line.startswith("## "):
            section = line[3:]
        match = LINE.match(line)
        if match and section:
            names = re.findall(r"`([^`]+)`:", match["rest"]) or re.findall(r"^`([^`]+)`", match["rest"])
            entries.append((section, match["path"], names))
    return entries


def test_every_kind_of_extension_has_its_list():
    found = {section for section, _, _ in _entries()}
    for title in SECTIONS:
        assert any(s.startswith(title) for s in found), title
    assert len(_entries()) >= 20


@pytest.mark.parametrize("section, path, names", _entries(), ids=lambda v: v if isinstance(v, str) else None)
def test_each_listed_file_holds_the_names_it_lists(section, path, names):
    if "<" in path:  # a file the extension itself adds (lstune/memory/<technique>.py): its folder must exist
        assert (ROOT / path).parent.is_dir(), path
        return
    target = ROOT / path
    assert target.is_file(), f"{section}: {path} does not exist"
    text = target.read_text()
    for name in names:
        assert name in text, f"{section}: {path} has no {name!r}"
