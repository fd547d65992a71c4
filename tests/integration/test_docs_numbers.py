"""docs/'s numbers say what they are (issue 32), as README's do (test_readme_numbers.py): every length figure in a
docs page sits in a sentence — or a table whose caption, header or note — that labels it measured, emulated,
predicted, traced, or arithmetic (any form of the word: "the estimate predicts", "against the trace") (an exact count of a tensor's bytes, no model); and no page claims a measured
full-depth step longer than the longest the records hold (393,216 tokens on 2026-11-28, `lstune bench` on an H100;
147,456 before: every longer length measured until then was a 2-layer emulation with ballast). docs/benchmarks/ holds the records themselves and is not checked here."""

from __future__ import annotations

import re

import pytest

from tests.integration.conftest import REPO
from tests.integration.test_readme_numbers import LENGTH, _full_depth_records, prose, sentences

PAGES = sorted((REPO / "docs").glob("*.md"))
DOC_LABELS = ("measur", "emulat", "predict", "trace", "arithmetic")  # measured, predicts, the trace, …
DOC_LENGTH = re.compile(LENGTH.pattern + r"(?!\s*param)")  # not 277M parameters
FULL_DEPTH = re.compile(r"full[- ]depth|32[- ]layers?\b", re.I)
NOT_A_FULL_DEPTH_RUN = ("emulat", "predict", "not run", "not measured", "no full-depth", "2-layer", "2 layers",
                        "alst", "mst", "memo")


def _labelled(text: str) -> bool:
    return any(label in text.lower() for label in DOC_LABELS)


def _blocks(text: str) -> list[tuple[str, str]]:
    """(block, its context): a paragraph or list item is its own context; a table's rows take as context the
    paragraph before the table, the header row and the paragraph after it (a table's caption or note)."""
    paragraphs = [p for p in re.split(r"\n\s*\n", text) if p.strip()]
    found = []
    for i, para in enumerate(paragraphs):
        lines = para.splitlines()
        rows = [line for line in lines if line.lstrip().startswith("|")]
        if not rows:
            found += [(item, item) for item in re.split(r"\n(?=\s*- )", para)]
            continue
        rest = "\n".join(line for line in lines if not line.lstrip().startswith("|"))
        context = " ".join([paragraphs[i - 1] if i else "", rest, rows[0],
                            paragraphs[i + 1] if i + 1 < len(paragraphs) else ""])
        found += [(row, context) for row in rows[1:]]
        if rest.strip():
            found.append((rest, rest))
    return found


def unlabelled_lengths(text: str) -> list[str]:
    missing = []
    for block, context in _blocks(prose(text)):
        for sentence in sentences(block):
            if DOC_LENGTH.search(sentence) and not _labelled(sentence) and not (block is not context and
                                                                             _labelled(context)):
                missing.append(sentence)
    return missing


def _length(figure: str) -> float:
    return float(figure[:-1]) * {"K": 2**10, "M": 2**20}[figure[-1]]


def full_depth_claims_past(text: str, longest: int) -> list[str]:
    """Sentences that call a length past `longest` a measured full-depth step (and say nothing that makes it
    something else: emulated, predicted, not run, a paper's)."""
    return [s for s in sentences(prose(text)) if "measured" in s.lower() and FULL_DEPTH.search(s)
            and any(_length(m.group()) > longest for m in DOC_LENGTH.finditer(s))
            and not any(word in s.lower() for word in NOT_A_FULL_DEPTH_RUN)]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_length_figure_in_docs_is_labelled(page):
    missing = unlabelled_lengths(page.read_text())
    assert not missing, f"{page.name}: label these measured / emulated / predicted / traced:\n" + "\n".join(missing)


@pytest.mark.parametrize("page", [*PAGES, REPO / "README.md"], ids=lambda p: p.name)
def test_no_page_claims_a_measured_full_depth_step_past_the_records(page):
    longest = max(r["longest_ok"] for r in _full_depth_records())
    claims = full_depth_claims_past(page.read_text(), longest)
    assert not claims, f"{page.name}: no full-depth step past {longest:,} tokens has run:\n" + "\n".join(claims)


def test_the_checks_fail_on_what_they_refuse():
    assert unlabelled_lengths("Offload reaches 352K. A measured 144K.") == ["Offload reaches 352K."]
    table = "Results:\n\n| run | longest |\n|---|---|\n| offload | 352K |\n"
    assert unlabelled_lengths(table) == ["| offload | 352K |"]
    assert unlabelled_lengths(table.replace("Results:", "Measured (2026-11-23):")) == []
    assert full_depth_claims_past("A full-depth step measured 512K.", 147456) == ["A full-depth step measured 512K."]
    assert full_depth_claims_past("A full-depth step measured 144K; emulated 512K.", 147456) == []
    assert full_depth_claims_past("Measured at full depth: 144K.", 147456) == []
