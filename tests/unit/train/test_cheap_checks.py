"""Cheap checks before expensive ones (issue 38): a model folder without weights, an unreadable tokenizer and a
missing data file are reported together, before the memory estimate and before torch is imported; and a LoRA run
whose final/ will have no loadable base is warned about at the start and noted in final/."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from lstune.config.load import build_config
from lstune.train.preflight import NO_BASE_NOTE, adapter_without_base, preflight_problems

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture
def folder_without_weights(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    (folder / "tokenizer.json").write_text('{"version": ')  # cut short
    return folder


def test_weights_tokenizer_and_data_reported_together(folder_without_weights, tmp_path):
    config = build_config({}, {"model": str(folder_without_weights), "data": str(tmp_path / "missing.jsonl")})
    problems = preflight_problems(config)
    assert any("a folder without weights" in p and "--init random" in p for p in problems), problems
    assert any("tokenizer file tokenizer.json cannot be read" in p for p in problems), problems
    assert any("missing.jsonl: no such file" in p for p in problems), problems


def test_weights_are_not_needed_for_a_random_init_or_a_data_preview(folder_without_weights):
    (folder_without_weights / "tokenizer.json").unlink()
    random = build_config({}, {"model": str(folder_without_weights), "init": "random", "data": "builtin:passkey"})
    assert preflight_problems(random) == []
    auto = build_config({}, {"model": str(folder_without_weights), "data": "builtin:passkey"})
    assert preflight_problems(auto, weights=False) == []
    (folder_without_weights / "model.safetensors").write_bytes(b"")
    assert preflight_problems(auto) == []


def test_the_cli_answers_before_importing_torch(folder_without_weights, tmp_path):
    """`lstune train` on these mistakes exits 2 with every problem, and torch was never imported (so neither the
    estimate nor any model code ran)."""
    probe = (
        "import sys\n"
        "from lstune.cli.app import main\n"
        "try:\n"
        f"    main(['train', '--model', {str(folder_without_weights)!r}, '--data', {str(tmp_path / 'no.jsonl')!r},"
        f" '--output-dir', {str(tmp_path / 'out')!r}])\n"
        "except SystemExit as exc:\n"
        "    print('exit', exc.code, 'torch' in sys.modules, 'transformers' in sys.modules)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=120)
    assert done.stdout.strip().splitlines()[-1] == "exit 2 False False", done.stdout + done.stderr
    assert "folder without weights" in done.stderr and "tokenizer.json" in done.stderr and "no.jsonl" in done.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("flags, kind, warned", [
    ({"lora_r": 8}, "preset", True),
    ({"lora_r": 8, "merge_lora": True}, "preset", False),
    ({"lora_r": 8, "init": "random"}, "local", True),
    ({"lora_r": 8}, "local", False),
    ({}, "preset", False),
])
def test_lora_without_a_loadable_base_is_warned(flags, kind, warned):
    config = build_config({}, {"data": "builtin:passkey", **{k: str(v) if not isinstance(v, bool) else v
                                                              for k, v in flags.items()}})
    warning = adapter_without_base(config, kind)
    assert (warning is not None) == warned
    if warned:
        assert warning.startswith("warning:") and "--merge-lora" in warning and NO_BASE_NOTE in warning


def test_final_gets_the_note(tmp_path):
    from lstune.train.run import _note_missing_base

    config = build_config({}, {"data": "builtin:passkey", "lora_r": "8"})
    _note_missing_base(config, "preset", tmp_path, SimpleNamespace(is_main=True))
    text = (tmp_path / NO_BASE_NOTE).read_text()
    assert "cannot be loaded on its own" in text and "--merge-lora" in text
    other = tmp_path / "other"
    other.mkdir()
    _note_missing_base(build_config({}, {"data": "builtin:passkey", "lora_r": "8", "merge_lora": True}), "preset",
                       other, SimpleNamespace(is_main=True))
    assert not (other / NO_BASE_NOTE).exists()
