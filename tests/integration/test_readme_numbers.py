"""The README's numbers say what they are (issue 32): every length figure sits in a sentence that labels it measured,
emulated, predicted or traced; the single-GPU headline is the longest full-depth step the records hold; and every
`lstune estimate` command in the README gives the verdict (and the longest length) the README says it gives."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from lstune.config.parse import format_length
from tests.integration.conftest import REPO

README = REPO / "README.md"
LABELS = ("measured", "emulated", "predicted", "traced")
LENGTH = re.compile(r"(?<![\w.,])\d+(?:\.\d+)?\s?[KM](?![\w])")  # 36K, 1.04M; not 8 KiB, not `--seq-len 32k`
VERDICT = re.compile(r"#\s*verdict:\s*(fits|does not fit)(?:;\s*longest\s+(\S+))?")


def prose(text: str) -> str:
    """The README without code: fenced blocks and inline code (flags and commands hold lengths that are inputs)."""
    text = re.sub(r"```.*?```", " ", text, flags=re.S)
    return re.sub(r"`[^`]*`", "`…`", text)


def sentences(text: str) -> list[str]:
    """Paragraphs, list items and table rows, cut at each sentence's end."""
    parts = []
    for block in re.split(r"\n\s*\n|\n(?=\s*[-|] )", text):
        parts += re.split(r"(?<=[.!?])\s+(?=[A-Z*\[(])", " ".join(block.split()))
    return parts


def unlabelled_lengths(text: str) -> list[str]:
    return [s for s in sentences(prose(text)) if LENGTH.search(s) and not any(label in s.lower() for label in LABELS)]


def test_every_length_figure_in_the_readme_is_labelled():
    missing = unlabelled_lengths(README.read_text())
    assert not missing, "label these measured / emulated / predicted / traced:\n" + "\n".join(missing)


def test_the_check_fails_on_an_unlabelled_figure():
    assert unlabelled_lengths("On one H100 the longest step is 512K. Measured (2026-11-23): 144K.") == [
        "On one H100 the longest step is 512K."]
    assert unlabelled_lengths("Flags: `--seq-len 500k`. A measured 36K.") == []


def _full_depth_records() -> list[dict]:
    """Every full-depth GPU result on record, as {"longest_ok": tokens}: the harness's 32-layer length searches
    (tools/gpu/bench_ladder.py, raw*/bench.jsonl; its 2-layer emulations carry `as_layers` and do not count) and the
    steps `lstune bench` completed on a CUDA device (bench.json with `measurements`: it always runs the whole model)."""
    records = []
    for path in sorted((REPO / "docs" / "benchmarks").glob("*/raw*/bench.jsonl")):
        records += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    found = [r for r in records if r.get("kind") == "maxlen" and r.get("layers") == 32 and not r.get("as_layers")]
    for path in sorted((REPO / "docs" / "benchmarks").glob("*/bench.json")):
        for m in json.loads(path.read_text()).get("measurements", []):
            if m.get("outcome") == "ok" and str(m.get("device", "")).startswith("cuda") and m.get("step_times_s"):
                found.append({"longest_ok": m["seq_len"], "record": str(path)})
    return found


def test_the_single_gpu_headline_is_the_measured_full_depth_maximum():
    longest = max(r["longest_ok"] for r in _full_depth_records())
    section = README.read_text().split("### Long sequences on one device", 1)[1].split("\n### ", 1)[0]
    bold = re.findall(r"\*\*([\d.]+[KM])\*\*", section)
    assert bold and bold[0] == format_length(longest).upper(), (bold, longest)
    headline = next(s for s in sentences(prose(section)) if f"**{bold[0]}**" in s)
    assert "measured" in headline.lower() and "full depth" in headline.lower(), headline


def estimate_commands() -> list[tuple[str, str, str | None]]:
    """(command, verdict, longest or None) of every `lstune estimate` line in the README's code blocks."""
    found = []
    for block in re.findall(r"```(?:bash)?\n(.*?)```", README.read_text(), flags=re.S):
        for line in block.splitlines():
            if line.strip().startswith("lstune estimate"):
                verdict = VERDICT.search(line)
                found.append((line.split("#")[0].strip(), verdict.group(1) if verdict else "",
                              verdict.group(2) if verdict else None))
    return found


def test_every_readme_estimate_command_states_its_verdict():
    commands = estimate_commands()
    assert len(commands) >= 2
    assert all(verdict for _, verdict, _ in commands), [c for c, v, _ in commands if not v]


@pytest.mark.parametrize("command, verdict, longest", estimate_commands())
def test_every_readme_estimate_command_gives_the_verdict_the_readme_says(cli, command, verdict, longest):
    args = shlex.split(command)[1:]
    result = cli(*args, *([] if "--json" in args else ["--json"]))
    assert result.code == 0, result.err
    data = json.loads(result.out)
    assert data["fits"] is (verdict == "fits"), (command, data["verdict"])
    if longest is not None:
        assert format_length(data["longest_seq_len"]).upper() == longest.upper(), (command, data["longest_seq_len"])
    assert data["hardware"]["host_source"] == "--host-mem" or "assumed" in data["hardware"]["host_source"]


def test_recipes_label_what_they_say_they_measured():
    """A recipe's comment block that reports a length says how it was obtained (its title line and command say what
    it configures, not a result)."""
    for recipe in sorted(Path(REPO / "recipes").glob("*/*.yaml")):
        lines = [line[1:] for line in recipe.read_text().splitlines() if line.startswith("#")][1:]
        comments = "\n".join(line for line in lines if "lstune train" not in line and not line.strip().startswith(
            "Hardware:"))
        missing = unlabelled_lengths(comments)
        assert not missing, (recipe.name, missing)
