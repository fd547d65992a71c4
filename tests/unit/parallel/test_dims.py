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


def test_a_model_without_attention_heads_gets_no_sequence_parallelism():
    from transformers import MambaConfig

    config = MambaConfig(hidden_size=32, num_hidden_layers=2)
    dims = ParallelDims.for_model(2, "auto", config)
    assert (dims.q_heads, dims.sp) == (1, 1)
    with pytest.raises(ConfigError, match="no attention heads.*use --sp 1"):
        ParallelDims.for_model(2, 2, config)


def test_build_groups_needs_distributed():
    with pytest.raises(RuntimeError, match="initialised"):
        ParallelDims(2, 2).build_groups()
