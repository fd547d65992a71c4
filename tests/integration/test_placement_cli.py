"""The checkpoint placement (MEMO) in `lstune train`'s printed plan, and its bad values' exit 2."""

from __future__ import annotations

from tests.integration.conftest import TINY_MODEL

ONE = 256 * 128 * 4  # one fp32 tiny-llama checkpoint at 256 tokens


def test_train_prints_the_placement(cli, tmp_path, text_data):
    result = cli("train", *TINY_MODEL, "--data", text_data, "--max-steps", "1", "--output-dir", tmp_path / "run",
                 "--offload-checkpoints", "--host-mem-budget", str(2 * ONE), "--checkpoint-device-budget", str(4 * ONE))
    assert result.code == 0, result.err
    flat = " ".join(result.out.split())
    assert "checkpoint placement: host 0-1; device 2-3 (host 0.2 MiB, device 0.2 MiB, recompute +0.0%" in flat, flat


def test_a_bad_checkpoint_device_budget_exits_2(cli, tmp_path, text_data):
    result = cli("train", *TINY_MODEL, "--data", text_data, "--output-dir", tmp_path / "run",
                 "--checkpointing", "off", "--checkpoint-device-budget", "1G")
    assert result.code == 2 and "Traceback" not in result.err
    assert "--checkpoint-device-budget places activation checkpoints: it needs --checkpointing on" in result.err


def _host_with_usable(nbytes: int) -> int:
    """A host this small keeps half for the OS, and a fit keeps 4 % of the rest free (issue 32's margin): the RAM
    whose usable part within the margin is `nbytes` (before the margin: 2 × nbytes)."""
    usable = -(-nbytes * 100 // 96)
    while usable - int(usable * 0.04) < nbytes:
        usable += 1
    return 2 * usable


def test_train_caps_the_host_at_the_machines_memory_as_the_estimate_chose(cli, tmp_path, text_data, monkeypatch):
    """No budget flags: the estimate's host budget (the machine's usable RAM per rank less the process's reserve; a
    host this small keeps half for the OS, lstune.estimate.memory.host_reserve_bytes) and device
    budget (the headroom, the host holding too little) reach lstune train, which prints them and places by them —
    room for two checkpoints puts layers 0-1 on the host (unbounded, offload would take 0-2)."""
    from lstune.estimate import hardware
    from lstune.estimate.memory import HOST_PROCESS_BYTES

    monkeypatch.setattr(hardware, "local_host_bytes", lambda: _host_with_usable(HOST_PROCESS_BYTES + 2 * ONE))
    result = cli("train", *TINY_MODEL, "--data", text_data, "--max-steps", "1", "--output-dir", tmp_path / "run",
                 "--offload-checkpoints")
    assert result.code == 0, result.err
    flat = " ".join((result.out + result.err).split())
    assert ("checkpoint budgets: host 0.2 MiB (the host's usable 2.0 GiB within the margin less 2.0 GiB else on it), "
            "device ") in flat
    assert "checkpoint placement: host 0-1; device 2-3 (host 0.2 MiB, device 0.2 MiB, recompute +0.0%" in flat, flat


def test_the_users_host_budget_wins_over_the_machines_memory(cli, tmp_path, text_data, monkeypatch):
    from lstune.estimate import hardware
    from lstune.estimate.memory import HOST_PROCESS_BYTES

    monkeypatch.setattr(hardware, "local_host_bytes", lambda: _host_with_usable(HOST_PROCESS_BYTES + 2 * ONE))
    result = cli("train", *TINY_MODEL, "--data", text_data, "--max-steps", "1", "--output-dir", tmp_path / "run",
                 "--offload-checkpoints", "--host-mem-budget", str(ONE))
    assert result.code == 0, result.err
    flat = " ".join((result.out + result.err).split())
    assert "checkpoint budgets: device " in flat and "checkpoint budgets: host" not in flat
    assert "checkpoint placement: host 0; device 1-3" in flat, flat
