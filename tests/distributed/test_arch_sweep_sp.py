"""The architecture sweep under SP 2 (tests/support/arch_sweep.py --sp 2) on the families where it found defects:
every case exact, refused with lstune's own error, or caught by the startup self-check under SP."""

from __future__ import annotations

import pytest

FOUND = {
    "afmoe": "its attention `.view`s the output, which Ulysses returned permuted (a crash)",
    "jetmoe": "the same",
    "minimax": "linear-attention layers run on each rank's shard only: caught by the self-check under SP",
}


def test_the_families_the_sp_sweep_found_wrong_are_exact_or_refused(pools):
    from transformers import CONFIG_MAPPING

    from tests.support import arch_sweep

    types = [t for t in FOUND if t in CONFIG_MAPPING]
    if not types:
        pytest.skip("this transformers has none of these model types")
    records = pools[2].run(arch_sweep._sp_worker, types, timeout=600)[0]
    for record in records:
        assert "outcome" not in record, (record["model_type"], record.get("outcome"))
        cases = {k: v for k, v in record.items() if "/" in k}
        assert len(cases) == 2 * len(arch_sweep.SP_TECHNIQUES)
        for case, outcome in cases.items():
            assert outcome.startswith(("exact", "refused", "WRONG (caught by the self-check)")), (
                record["model_type"], case, outcome)
    assert records[0]["long/attention"] == "exact"  # afmoe: the crash is gone, not refused away
