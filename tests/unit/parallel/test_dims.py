"""ParallelDims: dp × sp layout, `--sp auto`, errors for degrees that cannot work."""

from __future__ import annotations

import pytest

from lstune.errors import ConfigError, UserError
from lstune.parallel.dims import ParallelDims, auto_sp_degree, heads_split_evenly, valid_sp_degrees


def test_dp_is_the_rest_of_the_world():
    dims = ParallelDims(8, 4)
    assert (dims.sp, dims.dp) == (4, 2)


def test_rank_layout_keeps_sp_groups_contiguous():
    dims = ParallelDims(8, 4, rank=6)
    assert (dims.sp_rank, dims.dp_rank) == (2, 1)
    assert dims.sp_group_ranks(1) == [4, 5, 6, 7]
    assert dims.dp_group_ranks(2) == [2, 6]


@pytest.mark.parametrize(
    ("world", "q", "kv", "expected"),
    [
        (8, 32, 8, 8),  # ALST: even, all ranks to SP
        (8, 32, 4, 8),  # kv replicated
        (8, 28, 4, 4),  # 28 % 8 != 0 → largest even degree, DP takes the rest
        (8, 9, 3, 8),  # only SP=1 is even → uneven heads on all 8 ranks
        (16, 40, 8, 8),
        (4, 2, 2, 2),  # never more SP ranks than heads
        (1, 32, 8, 1),
    ],
)
def test_auto_degree(world, q, kv, expected):
    assert auto_sp_degree(world, q, kv) == expected
    assert ParallelDims(world, "auto", q_heads=q, kv_heads=kv).sp == expected


def test_even_split_rule_follows_alst():
    assert heads_split_evenly(8, 32, 8) and heads_split_evenly(32, 32, 8) and heads_split_evenly(8, 32, 4)
    assert not heads_split_evenly(4, 9, 3) and not heads_split_evenly(8, 12, 3)


def test_valid_degrees_divide_world_and_fit_heads():
    assert valid_sp_degrees(8) == [1, 2, 4, 8]
    assert valid_sp_degrees(8, q_heads=3) == [1, 2]


@pytest.mark.parametrize(("world", "sp", "heads"), [(8, 3, 32), (4, 8, 32), (8, 8, 4)])
def test_invalid_sp_is_a_user_error_listing_valid_degrees(world, sp, heads):
    with pytest.raises(ConfigError) as err:
        ParallelDims(world, sp, q_heads=heads)
    message = str(err.value)
    assert f"--sp {sp}" in message
    assert ", ".join(map(str, valid_sp_degrees(world, heads))) in message
    assert isinstance(err.value, UserError)


def test_for_model_reads_head_counts():
    from lstune.models.presets import preset_config

    dims = ParallelDims.for_model(4, "auto", preset_config("tiny-gemma3"))
    assert (dims.q_heads, dims.kv_heads, dims.sp) == (4, 1, 4)


def test_an_attention_free_model_takes_its_sp_cap_from_its_mixers_units():
    """Mamba-1 (Mamba, FalconMamba) splits by channel, Mamba-2 by SSM head (lstune.models.mixers)."""
    from transformers import FalconMambaConfig, Mamba2Config, MambaConfig

    mamba = MambaConfig(hidden_size=32, num_hidden_layers=2, intermediate_size=6)
    assert ParallelDims.for_model(4, "auto", mamba).sp == 2  # 6 channels split evenly over 2, not 4
    assert (ParallelDims.for_model(4, 4, mamba).q_heads, ParallelDims.for_model(4, 4, mamba).sp) == (6, 4)
    with pytest.raises(ConfigError, match="at most the number of heads"):
        ParallelDims.for_model(8, 8, mamba)
    assert ParallelDims.for_model(2, 2, FalconMambaConfig(hidden_size=32, num_hidden_layers=2)).q_heads == 64
    assert ParallelDims.for_model(4, "auto", Mamba2Config(hidden_size=32, num_heads=4, head_dim=16)).sp == 4
    with pytest.raises(ConfigError, match="ring attention needs attention"):
        ParallelDims.for_model(2, 2, mamba, ring=2)


def test_a_model_without_heads_or_a_known_mixer_gets_no_sequence_parallelism():
    from transformers import RwkvConfig

    config = RwkvConfig(hidden_size=32, num_hidden_layers=2)
    dims = ParallelDims.for_model(2, "auto", config)
    assert (dims.q_heads, dims.sp) == (1, 1)
    with pytest.raises(ConfigError, match="no attention heads and no token mixer.*use --sp 1"):
        ParallelDims.for_model(2, 2, config)


def test_build_groups_needs_distributed():
    with pytest.raises(RuntimeError, match="initialised"):
        ParallelDims(2, 2).build_groups()


@pytest.mark.parametrize(("world", "sp", "ring", "q", "node", "expected"), [
    (4, 4, "auto", 2, None, (2, 2)),  # 2 heads: Ulysses 2, ring 2
    (4, 4, "auto", 4, None, (4, 1)),  # heads allow all of it: no ring
    (4, 4, 4, 4, None, (1, 4)),
    (64, 64, "auto", 32, 8, (8, 8)),  # Llama-3.1-8B on 8 nodes of 8: Ulysses inside a node, the ring across
    (128, 128, "auto", 64, 8, (8, 16)),
    (8, 8, "auto", 9, None, (8, 1)),  # uneven Ulysses plan counts (9 heads on 8)
])
def test_ulysses_times_ring_split(world, sp, ring, q, node, expected):
    dims = ParallelDims(world, sp, q_heads=q, kv_heads=1, ring=ring, node_size=node)
    assert (dims.ulysses, dims.ring) == expected


def test_ring_groups_take_every_ulysses_th_rank_and_ulysses_groups_stay_consecutive():
    dims = ParallelDims(16, 8, ring=4, rank=13)  # SP blocks of 8: Ulysses 2 × ring 4
    assert (dims.sp_rank, dims.ring_rank, dims.ulysses_rank) == (5, 2, 1)
    assert dims.ring_group_ranks(1, 1) == [9, 11, 13, 15]
    assert dims.ulysses_group_ranks(1, 2) == [12, 13]


def test_sp_past_the_heads_needs_a_ring():
    with pytest.raises(ConfigError, match="--sp-ring"):
        ParallelDims(4, 4, q_heads=2, kv_heads=1)
    with pytest.raises(ConfigError, match="--sp-ring 3"):
        ParallelDims(4, 4, q_heads=2, kv_heads=1, ring=3)
    assert ParallelDims(4, "auto", q_heads=2, kv_heads=1, ring=2).sp == 4
    auto = ParallelDims(8, "auto", q_heads=2, kv_heads=1, ring="auto")  # every process to SP, Ulysses 2 × ring 4
    assert (auto.sp, auto.ulysses, auto.ring, auto.dp) == (8, 2, 4, 1)
