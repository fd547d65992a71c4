"""gpt-oss (learned attention sinks, alternating 16-token windows) under Ulysses SP on 2 and 4 gloo processes: each
rank applies its q heads' slice of the sinks, in lstune's block kernel and after chunked attention's merge. Loss and
every gradient (the sinks' included) equal plain HF eager on the whole sequence, each packed document alone. The
6-head model splits unevenly on 4 ranks (2, 2, 1, 1 q heads), so each rank's slice has its own size and start."""

from __future__ import annotations

import pytest

from tests.distributed._helpers import assert_sp_matches_hf

SEQ = 96
DOCS = [41, 30, 25]
TOL = 2e-5
VARIANTS = {
    "alone": None,
    "chunked": dict(attn_chunks=3, tiled_mlp="off", tiled_loss="off", checkpointing=False),
    "everything": dict(attn_chunks=3, tiled_mlp=2, tiled_loss=2, mini_sequence=True, offload_checkpoints=True),
}


def _build(model_type: str):
    import torch

    from tests.support.archs import tiny_model

    heads = dict(num_attention_heads=6, num_key_value_heads=2) if model_type == "gpt_oss_6_heads" else {}
    model = tiny_model("gpt_oss", **heads)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("sinks"):
                param.copy_(torch.randn(param.shape, generator=torch.Generator().manual_seed(5)) * 2)
    return model


def _sinks_sp_worker(rank: int, world: int, model_types: list[str]) -> dict:
    import logging
    import warnings

    from tests.distributed._helpers import compare_sp_with_hf, lstune_sp_variant, reference_samples

    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    variants = {name: lstune_sp_variant(world, SEQ, memory=memory) for name, memory in VARIANTS.items()}
    return compare_sp_with_hf(model_types, reference_samples(SEQ, DOCS), variants, build=_build)


@pytest.mark.parametrize("world", [2, 4])
def test_gpt_oss_under_sp_matches_hf(pools, world):
    model_types = ["gpt_oss", "gpt_oss_6_heads"]
    results = pools[world].run(_sinks_sp_worker, model_types, timeout=600)
    assert_sp_matches_hf(results[0], len(model_types) * 2 * len(VARIANTS), loss_tol=TOL, grad_tol=1e-4)
