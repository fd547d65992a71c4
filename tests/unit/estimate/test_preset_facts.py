"""lstune.estimate.preset_facts: a preset's estimate needs neither torch nor transformers (issue 32: `lstune
estimate` took 8.3 CPU-seconds, half of it importing them), and the facts kept for it are what transformers and peft
say today."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from lstune.estimate.preset_facts import counts_for, preset_config_facts, preset_counts
from lstune.estimate.shapes import ModelShape, count_parameters
from lstune.models.presets import list_presets, preset_config
from tests.integration.conftest import REPO


def test_every_preset_has_facts_equal_to_transformers_config():
    for name in list_presets():
        facts = preset_config_facts(name)
        assert facts is not None, f"{name}: run python -m lstune.estimate.preset_facts"
        live = json.loads(preset_config(name).to_json_string(use_diff=False))
        assert facts.to_dict() == live, f"{name}: run python -m lstune.estimate.preset_facts"
        assert ModelShape.from_config(facts) == ModelShape.from_config(preset_config(name))


@pytest.mark.parametrize("name", ["llama-3.1-8b", "qwen3-8b", "gemma-3-1b", "phi-3-mini", "mixtral-8x7b",
                                  "qwen3-30b-a3b"])
def test_the_kept_counts_are_count_parameters_of_the_built_model(name):
    facts, live = preset_config_facts(name), preset_config(name)
    for lora_r in (0, 7, 16):  # LoRA's counts scale with the rank: an odd one too
        kept = preset_counts(facts, lora_r=lora_r, lora_targets="auto")
        assert kept == count_parameters(live, lora_r=lora_r), (name, lora_r)
    assert preset_counts(facts, lora_r=16, lora_targets=["o_proj"]) is None  # other targets: the full path
    assert counts_for(facts, lora_r=16, lora_targets=["o_proj"]) == count_parameters(
        live, lora_r=16, lora_targets=["o_proj"])


def test_an_estimate_of_a_preset_imports_neither_torch_nor_transformers():
    """Nor does it build the model to count its parameters; the run plan's attention checks are torch-free
    (lstune.models.attention_backends)."""
    code = ("import resource, sys\n"
            "from lstune.cli.app import main\n"
            "try:\n"
            "    main(['estimate', '--model', 'llama-3.1-8b', '--seq-len', '128k', '--gpu', 'h100-80gb'])\n"
            "except SystemExit:\n"
            "    pass\n"
            "r = resource.getrusage(resource.RUSAGE_SELF)\n"
            "print('torch' in sys.modules, 'transformers' in sys.modules, r.ru_utime + r.ru_stime, file=sys.stderr)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    torch, transformers, cpu_seconds = done.stderr.split()[-3:]
    assert "verdict" in done.stdout and (torch, transformers) == ("False", "False"), done.stderr[-2000:]
    assert float(cpu_seconds) < 3.0  # ~1.1 s on the shared development machine (8.3 before issue 32)
