"""Llama-4 (llama4_text) under Ulysses SP on 2 and 4 gloo processes, alone, with chunked attention (FPDT) and under
Ulysses × ring ((1, 2), (2, 2), (1, 4); at (1, 2) and (1, 4) with FPDT's chunks under the ring too): loss and every gradient equal plain HF eager on the whole sequence, each
packed document alone (fp32).

The chunked-attention layer's 12-token chunks do not line up with the shards (52 tokens on 2 ranks, 26 on 4: every
rank but the first starts mid-chunk, where transformers' mask on the shard counts chunks from the shard's start) nor
with FPDT's pieces (13 tokens on 4 ranks: no piece holds a whole chunk plus one), so chunk membership must come from
the global position_ids; the NoPE layer's temperature steps every 4 positions, so a rank computing it from its shard's
token index (transformers' own rule) would differ from the whole sequence."""

from __future__ import annotations

import pytest

from tests.distributed._helpers import assert_sp_matches_hf

SEQ = 104
DOCS = [45, 34, 25]
TOL = 2e-5
CONFIG = dict(attention_chunk_size=12, floor_scale=4, attn_scale=1.0)
VARIANTS = {
    "alone": None,
    "chunked": dict(attn_chunks=2, tiled_mlp="off", tiled_loss="off", checkpointing=False),
    "everything": dict(attn_chunks=2, tiled_mlp=2, tiled_loss=2, mini_sequence=True, offload_checkpoints=True),
}


def _build(model_type: str):
    from tests.support.archs import tiny_model

    return tiny_model("llama4_text", **CONFIG)


def _llama4_sp_worker(rank: int, world: int, model_types: list[str]) -> dict:
    import logging
    import warnings

    from tests.distributed._helpers import compare_sp_with_hf, lstune_sp_variant, reference_samples

    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    variants = {name: lstune_sp_variant(world, SEQ, memory=memory) for name, memory in VARIANTS.items()}
    return compare_sp_with_hf(model_types, reference_samples(SEQ, DOCS), variants, build=_build)


RING_LAYOUTS = {2: [(1, 2)], 4: [(2, 2), (1, 4)]}


def _llama4_ring_worker(rank: int, world: int, layouts: list[tuple[int, int]]) -> dict:
    """Ulysses × ring ((Ulysses, ring) layouts): the ring takes the chunk positions Ulysses hands its core."""
    import logging
    import warnings

    from tests.distributed._helpers import compare_sp_with_hf, lstune_sp_variant, reference_samples

    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    variants = {f"{u}x{r}": lstune_sp_variant(world, SEQ, ring=r) for u, r in layouts}
    variants[f"{layouts[0][0]}x{layouts[0][1]}-memory"] = lstune_sp_variant(
        world, SEQ, ring=layouts[0][1], memory=dict(tiled_mlp=2, tiled_loss=2, mini_sequence=True,
                                                    offload_checkpoints=True))
    # FPDT's chunks under the ring (issue 35): the model's chunk positions reach the chunk sink through the ring
    variants[f"{layouts[-1][0]}x{layouts[-1][1]}-fpdt"] = lstune_sp_variant(world, SEQ, ring=layouts[-1][1],
                                                                           memory=dict(attn_chunks=2))
    return compare_sp_with_hf(["llama4_text"], reference_samples(SEQ, DOCS), variants, build=_build)


@pytest.mark.parametrize("world", [2, 4])
def test_llama4_under_sp_matches_hf(pools, world):
    results = pools[world].run(_llama4_sp_worker, ["llama4_text"], timeout=600)
    assert_sp_matches_hf(results[0], 2 * len(VARIANTS), loss_tol=TOL, grad_tol=1e-4)


@pytest.mark.parametrize("world", [2, 4])
def test_llama4_under_ulysses_and_ring_matches_hf(pools, world):
    results = pools[world].run(_llama4_ring_worker, RING_LAYOUTS[world], timeout=600)
    assert_sp_matches_hf(results[0], 2 * (len(RING_LAYOUTS[world]) + 2), loss_tol=TOL, grad_tol=1e-4)
    assert all(detail[4] == 2 for key, (_, detail) in results[0].items() if key[2].endswith("fpdt"))
