"""gpt-oss (learned attention sinks, alternating 16-token sliding windows) under ring attention on gloo: (Ulysses,
ring) = (1, 2) on 2 processes, (2, 2) and (1, 4) on 4. The ring applies each rank's q heads' slice of the sinks once
after its merge (`attention_sinks.apply_sinks`); the 3-head model splits unevenly over 2 Ulysses ranks (2 and 1 q
heads), so each slice has its own size and start; with an 8-token window (shorter than a zigzag piece at ring 4) the
ring skips hop 2, and each row still gets its sink once. One long sample and packed documents whose boundaries cross the
zigzag pieces; alone and with the memory techniques (tiled MLP and loss, mini-sequence, offloaded checkpoints). Loss
and every gradient (the sinks' included) equal plain HF eager on the whole sequence, each packed document alone."""

from __future__ import annotations

import pytest

from tests.distributed._helpers import assert_sp_matches_hf

SEQ = 96
DOCS = [41, 30, 25]
TOL = 2e-5
LAYOUTS = {2: [(1, 2)], 4: [(2, 2), (1, 4)]}
MEMORY = dict(tiled_mlp=2, tiled_loss=2, mini_sequence=True, offload_checkpoints=True)
MODELS = {2: ["gpt_oss", "gpt_oss_3_heads"], 4: ["gpt_oss", "gpt_oss_3_heads", "gpt_oss_window_8"]}


def _build(model_type: str):
    import torch

    from tests.support.archs import tiny_model

    overrides = {"gpt_oss_3_heads": {"num_attention_heads": 3, "num_key_value_heads": 1},
                 "gpt_oss_window_8": {"sliding_window": 8}}.get(model_type, {})
    model = tiny_model("gpt_oss", **overrides)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("sinks"):
                param.copy_(torch.randn(param.shape, generator=torch.Generator().manual_seed(5)) * 2)
    return model


def _ring_sinks_worker(rank: int, world: int, layouts: list[tuple[int, int]], models: list[str]) -> dict:
    import logging
    import warnings

    from tests.distributed._helpers import compare_sp_with_hf, lstune_sp_variant, reference_samples

    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    variants = {f"{u}x{r}": lstune_sp_variant(world, SEQ, ring=r) for u, r in layouts}
    variants[f"{layouts[0][0]}x{layouts[0][1]}-memory"] = lstune_sp_variant(world, SEQ, ring=layouts[0][1],
                                                                             memory=MEMORY)
    return compare_sp_with_hf(models, reference_samples(SEQ, DOCS), variants, build=_build)


@pytest.mark.parametrize("world", [2, 4])
def test_gpt_oss_sinks_and_windows_under_ring_match_hf(pools, world):
    results = pools[world].run(_ring_sinks_worker, LAYOUTS[world], MODELS[world], timeout=600)
    assert_sp_matches_hf(results[0], len(MODELS[world]) * 2 * (len(LAYOUTS[world]) + 1), loss_tol=TOL, grad_tol=TOL)
    for other in results[1:]:
        for key, (outcome, detail) in other.items():
            assert outcome == "ran" and detail[2] < TOL, (key, outcome, detail)
