"""The cheapest changes' flags: made from the change itself, so that given after the user's own flags they are
exactly the configuration the suggestion was estimated for (tests/integration/test_estimate_cli.py applies them)."""

from __future__ import annotations

import pytest

from lstune.config.schema import TrainConfig
from lstune.estimate import _CHANGES, _MINI_OFFLOAD, change_flags, cheapest_changes
from lstune.estimate.hardware import resolve_hardware
from lstune.estimate.shapes import count_parameters
from lstune.models.presets import preset_config

GiB = 2**30


def _config(**flat) -> TrainConfig:
    return TrainConfig.from_flat({"model": "tiny-llama", **flat})


@pytest.mark.parametrize("flat, change, flags", [
    ({}, _CHANGES[3], "--offload-checkpoints"),
    # These printed only the first flag: applied, "needs --checkpointing on" and "drop --tiled-mlp off".
    ({"checkpointing": False}, _CHANGES[3], "--offload-checkpoints --checkpointing on"),
    ({"tiled_mlp": "off"}, _MINI_OFFLOAD, "--mini-sequence --offload-checkpoints --tiled-mlp auto"),
    ({}, {"zero_stage": "3", "offload_optimizer": True, "offload_params": True, "offload_ratio": 0.75},
     "--zero-stage 3 --offload-optimizer --offload-params --offload-ratio 0.75"),
    # The user's --sp 1 was kept when applied; the suggestion had been estimated with --sp auto.
    ({"sp": 1}, {"gpus": 4, "sp": "auto", **_MINI_OFFLOAD}, "--gpus 4 --sp auto --mini-sequence --offload-checkpoints"),
    ({"offload_checkpoints": False}, {"offload_checkpoints": False}, ""),
])
def test_the_flags_are_the_change_less_what_the_config_has(flat, change, flags):
    assert change_flags(change, _config(**flat)) == flags


def test_on_a_cpu_no_change_moves_bytes_to_the_same_ram_or_adds_processes():
    """--gpus 4 had been estimated with the 1-process RAM share as each process's (fits, 14.7 GiB; applied: 5.9 GiB
    per process, does not fit); offloading to the host of a CPU frees nothing of its one RAM."""
    hw = resolve_hardware(gpu="cpu", host_mem=24 * GiB)
    model_config = preset_config("tiny-llama")
    params = count_parameters(model_config, lora_r=0, lora_targets=None)
    found = cheapest_changes(_config(seq_len=8 << 20), hw, model_config, params)
    assert not any("offload" in s.flags or "--gpus" in s.flags for s in found), [s.flags for s in found]
