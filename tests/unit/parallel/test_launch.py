"""Launch detection and launcher commands (no processes started here; tests/distributed runs one)."""

from __future__ import annotations

import sys

import pytest

from lstune.errors import ConfigError
from lstune.parallel.launch import detect_launch_env, launch_command


def test_plain_process_is_not_launched():
    assert detect_launch_env({"PATH": "/bin"}) is None


def test_torchrun_environment():
    env = detect_launch_env({
        "RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "4", "MASTER_ADDR": "node-0",
        "MASTER_PORT": "29400", "TORCHELASTIC_RUN_ID": "abc",
    })
    assert env is not None
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size) == (3, 8, 3, 4)
    assert (env.master_addr, env.master_port, env.launcher) == ("node-0", 29400, "torchrun")
    assert not env.is_main


def test_deepspeed_launcher_environment():
    env = detect_launch_env({
        "RANK": "0", "WORLD_SIZE": "16", "LOCAL_RANK": "0", "LOCAL_SIZE": "8", "CROSS_RANK": "0",
        "CROSS_SIZE": "2", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500",
    })
    assert (env.launcher, env.local_world_size, env.is_main) == ("deepspeed", 8, True)


def test_accelerate_environment():
    env = detect_launch_env({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "ACCELERATE_MIXED_PRECISION": "bf16"})
    assert (env.launcher, env.rank, env.master_addr) == ("accelerate", 1, "127.0.0.1")


def test_openmpi_environment():
    env = detect_launch_env({
        "OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "4", "MASTER_ADDR": "n0",
    })
    assert (env.launcher, env.rank, env.world_size, env.local_rank, env.local_world_size) == ("mpi", 5, 8, 1, 4)


def test_single_node_uses_torchrun_with_the_same_argv():
    cmd = launch_command(["train", "--gpus", "8", "--seq-len", "2M"], 8)
    # torchrun through lstune.parallel.agent, which turns its failures into an exit code and a line.
    assert cmd[:2] == [sys.executable, "-c"] and "run_module('lstune.parallel.agent', run_name='__main__'" in cmd[2]
    assert cmd[cmd.index("--nproc-per-node") + 1] == "8"
    assert cmd[-5:] == ["train", "--gpus", "8", "--seq-len", "2M"]
    entry = cmd[cmd.index("--no-python") + 1 : -5]
    assert entry[:2] == [sys.executable, "-c"] and "run_module('lstune', run_name='__main__'" in entry[2]


def test_hostfile_uses_the_deepspeed_launcher(tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node-1 slots=8\nnode-2 slots=8\n")
    cmd = launch_command(["train"], 8, str(hostfile))
    assert cmd[2] == "deepspeed.launcher.runner"
    assert cmd[cmd.index("--hostfile") + 1] == str(hostfile)
    assert cmd[-3:] == ["--module", "lstune", "train"]


def test_missing_hostfile_is_a_user_error(tmp_path):
    with pytest.raises(ConfigError, match="slots=8"):
        launch_command(["train"], 8, str(tmp_path / "nope"))


def test_zero_gpus_is_a_user_error():
    with pytest.raises(ConfigError, match="--gpus 0"):
        launch_command(["train"], 0)


def test_more_gpus_than_cuda_devices_is_refused_before_launch(monkeypatch):
    """On a CUDA machine showing one device, --gpus 2 is an error before any process starts (not the second
    process's invalid device ordinal after the first has loaded)."""
    import subprocess

    import torch

    from lstune.parallel import launch

    monkeypatch.setattr(launch, "_cuda_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: pytest.fail("launched"))
    with pytest.raises(ConfigError, match=r"--gpus 2 but this machine shows 1 CUDA device \(CUDA_VISIBLE_DEVICES=3\)"):
        launch.relaunch(["train"], 2)
    assert launch.gpu_count_problems(1, 1) == [] and launch.gpu_count_problems(8, 8) == []


def test_the_launcher_gets_time_to_let_ranks_save_and_a_users_value_wins(monkeypatch):
    """torchrun kills the ranks 30 s after a signal by default, before a large checkpoint is written."""
    import subprocess

    from lstune.parallel import launch

    seen = []

    class Finished:
        def __init__(self, command, env, **kwargs):
            seen.append(env)

        def wait(self):
            return 0

    monkeypatch.setattr(launch, "_cuda_available", lambda: False)
    monkeypatch.setattr(subprocess, "Popen", Finished)
    monkeypatch.delenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", raising=False)
    assert launch.relaunch(["train"], 2) == 0
    monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "45")
    assert launch.relaunch(["train"], 2) == 0
    assert [env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] for env in seen] == ["600", "45"]


def test_gpus_on_cpu_are_bounded_by_the_cores_unless_forced(monkeypatch):
    import subprocess

    from lstune.errors import ConfigError
    from lstune.parallel import launch

    started = []

    class FakeLauncher:
        def __init__(self, command, **kwargs):
            started.append(command)

        def wait(self):
            return 0

        def send_signal(self, signum):
            pass

    monkeypatch.setattr(launch, "_cuda_available", lambda: False)
    monkeypatch.setattr(launch, "usable_cores", lambda: 2)
    monkeypatch.setattr(subprocess, "Popen", FakeLauncher)
    with pytest.raises(ConfigError, match="--gpus 3 on CPU starts 3 processes.*2 cores; use --gpus 2 or fewer, or --force"):
        launch.relaunch(["train"], 3)
    assert started == []
    assert launch.relaunch(["train"], 2) == 0
    assert launch.relaunch(["train"], 3, force=True) == 0
    assert len(started) == 2
