"""Run the real `lstune` CLI in-process (fast) or as a subprocess (for signals and startup)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from lstune.cli.app import main

REPO = Path(__file__).resolve().parents[2]


@dataclass
class CliResult:
    code: int
    out: str
    err: str


@pytest.fixture
def cli(capsys):
    def run(*args: str) -> CliResult:
        capsys.readouterr()
        try:
            main([str(a) for a in args])
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        captured = capsys.readouterr()
        return CliResult(code, captured.out, captured.err)

    return run


def run_subprocess(*args: str, timeout: float = 120, **kwargs) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.run(
        [sys.executable, "-m", "lstune", *map(str, args)], capture_output=True, text=True, timeout=timeout,
        env=env, cwd=kwargs.pop("cwd", REPO), **kwargs,
    )


def read_metrics(output_dir: Path) -> list[dict]:
    lines = (Path(output_dir) / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


@pytest.fixture
def text_data(tmp_path) -> Path:
    """A JSONL file of 12 short, learnable documents."""
    return write_text_data(tmp_path / "data.jsonl")


def write_text_data(path: Path) -> Path:
    """`text_data`'s file at `path` (for a fixture of wider scope)."""
    rows = [{"text": f"Document {i}: " + "the quick brown fox jumps over the lazy dog. " * (3 + i % 4)} for i in range(12)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# A tiny run's flags. --data repeats (several sources make a mixture), so a test giving its own --data starts from
# TINY_MODEL; TINY adds the bundled task as data.
TINY_MODEL = ["--model", "tiny-llama", "--seq-len", "256", "--lr", "1e-3", "--warmup-steps", "0"]
TINY = [*TINY_MODEL, "--data", "builtin:passkey"]


def light_help(command: str) -> str:
    """`lstune COMMAND --help`'s output, asserting it exits 0 having imported no torch, transformers, deepspeed
    or datasets (so it answers fast)."""
    return light_run([command, "--help"], code=0).stdout


def light_run(args: list[str], *, code: int) -> subprocess.CompletedProcess:
    """`lstune ARGS` in a fresh interpreter, asserting its exit code and that it imported none of torch,
    transformers, deepspeed or datasets (what makes an answer take seconds)."""
    argv = ["lstune", *map(str, args)]
    script = (
        f"import sys, runpy; sys.argv = {argv!r}"
        "\ntry:\n    runpy.run_module('lstune', run_name='__main__')\nexcept SystemExit as e:"
        f"\n    assert (e.code or 0) == {code}, e.code\nelse:\n    assert {code} == 0, 'exit 0'"
        "\nheavy = [m for m in ('torch', 'transformers', 'deepspeed', 'datasets') if m in sys.modules]"
        "\nassert not heavy, heavy"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc
