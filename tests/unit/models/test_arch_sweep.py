"""The architecture sweep (tests/support/arch_sweep.py) on the families where it found defects: every case is now
exact, refused with lstune's own error, or caught by the startup self-check — never silently wrong, never a crash.
The whole sweep (every causal-LM type transformers ships) is run by hand; docs/architecture-sweep.md has its table."""

from __future__ import annotations

import pytest

from tests.support import arch_sweep

FOUND = {
    "mamba": "its mixer (a causal scan) was tiled as if it were an MLP",
    "gemma4_unified": "per-layer head dims crashed the chunk sizing",
    "doge": "its attention reads the mask tensor: an AttributeError",
    "minimax": "linear attention leaked across packed documents, unseen by the self-check",
    "phimoe": "random routing made the self-check refuse at random",
    "bart": "its own loss (labels taken pre-shifted) was refused as an extra term",
}


@pytest.mark.parametrize("model_type", list(FOUND))
def test_the_families_the_sweep_found_wrong_are_exact_or_refused(model_type):
    from transformers import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:
        pytest.skip(f"this transformers has no {model_type}")
    record = arch_sweep.sweep_one(model_type)
    assert "outcome" not in record, record["outcome"]  # built: the check below ran
    cases = {key: value for key, value in record.items() if "/" in key and not key.endswith(":trace")}
    assert len(cases) == 2 * len(arch_sweep.TECHNIQUES)
    for case, outcome in cases.items():
        assert outcome.startswith(("exact", "refused", "WRONG (caught by the self-check)")), f"{case}: {outcome}"


def test_the_sweep_flags_a_silently_wrong_model(monkeypatch):
    """The sweep's own check can fail: with lstune's per-document mixers and the per-document reference of the
    self-check undone, MiniMax's packed cases come out as silently wrong."""
    from lstune.train import mixers, self_check

    monkeypatch.setattr(mixers, "install_mixers", lambda *args, **kwargs: None)
    monkeypatch.setattr(self_check, "_doc_starts", lambda batch: [0])
    record = arch_sweep.sweep_one("minimax")
    assert record["packed/attention"].startswith("WRONG (self-check passes)")
