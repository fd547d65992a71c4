"""Starting the processes of a distributed run, and joining one that a launcher started.

Three ways a run is distributed:

* `lstune train --gpus N` (no launcher in the environment): `relaunch` re-runs the same command under
  torchrun (`python -c <lstune.parallel.agent> --standalone --nproc-per-node N --no-python python -c ...`:
  torchrun's own `run`, its failures turned into an exit code and one line, lstune.parallel.agent), one
  process per GPU. Each process runs lstune's `__main__` from the lstune this process imported, not
  through `python -m lstune`: that puts the working directory first on sys.path, and a folder named
  `lstune` there would be imported instead. Without CUDA it starts N CPU processes with the gloo backend and DS_ACCELERATOR=cpu
  (for tests and demos).
* `lstune train --gpus N --hostfile H`: several nodes through DeepSpeed's launcher
  (`python -m deepspeed.launcher.runner --hostfile H --num_gpus N --module lstune ...`), which reaches
  the nodes over passwordless ssh (pdsh) and gives each process its rank. Hostfile format, one node a
  line: `node-1 slots=8`.
* Started by torchrun, `deepspeed` or `accelerate launch` already: `detect_launch_env` reads RANK,
  WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT (or OpenMPI's OMPI_COMM_WORLD_* variables) and the command
  runs as that rank; nothing is relaunched.

`init_distributed(env)` then joins the process group (lstune.parallel.comm.init_process_group): NCCL on
CUDA (one GPU per local rank), gloo otherwise. Torch's launcher is used as is — this module only decides
which one and passes the argv on.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Mapping

from lstune.config.schema import ParallelSection
from lstune.errors import ConfigError
from lstune.parallel.lifetime import preexec

# After a signal, how long torchrun lets the processes finish (save a checkpoint) before it kills them: its default,
# 30 s, is shorter than writing a large model's ZeRO checkpoint.
SHUTDOWN_TIMEOUT_S = 600

LAUNCHER_MARKERS = (
    ("TORCHELASTIC_RUN_ID", "torchrun"),
    ("ACCELERATE_MIXED_PRECISION", "accelerate"),
    ("ACCELERATE_DYNAMO_BACKEND", "accelerate"),
    ("CROSS_RANK", "deepspeed"),
    ("OMPI_COMM_WORLD_RANK", "mpi"),
)


@dataclass(frozen=True)
class LaunchEnv:
    """Where this process sits in a launched run, as the launcher described it in the environment."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    launcher: str  # torchrun | deepspeed | accelerate | mpi | env

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def detect_launch_env(environ: Mapping[str, str] | None = None) -> LaunchEnv | None:
    """The launch environment this process was started in, or None for a plain single process."""
    env = os.environ if environ is None else environ
    rank = _first(env, "RANK", "OMPI_COMM_WORLD_RANK")
    world = _first(env, "WORLD_SIZE", "OMPI_COMM_WORLD_SIZE")
    if rank is None or world is None:
        return None
    local_rank = _first(env, "LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK") or "0"
    local_world = _first(env, "LOCAL_WORLD_SIZE", "LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE") or world
    launcher = next((name for var, name in LAUNCHER_MARKERS if var in env), "env")
    return LaunchEnv(
        rank=int(rank),
        world_size=int(world),
        local_rank=int(local_rank),
        local_world_size=int(local_world),
        master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
        master_port=int(env.get("MASTER_PORT", "29500")),
        launcher=launcher,
    )


def _first(env: Mapping[str, str], *names: str) -> str | None:
    return next((env[n] for n in names if env.get(n)), None)


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def gpu_count_problems(gpus: int, visible: int) -> list[str]:
    """--gpus N on one CUDA machine needs N visible devices: the N-th process would otherwise stop on an invalid
    device ordinal after the others have loaded. (On CPU the processes are gloo processes, as many as asked.)"""
    if gpus <= visible:
        return []
    shown = os.environ.get("CUDA_VISIBLE_DEVICES")
    where = f" (CUDA_VISIBLE_DEVICES={shown})" if shown is not None else ""
    return [f"--gpus {gpus} but this machine shows {visible} CUDA device{'s' if visible != 1 else ''}{where}; "
            f"use --gpus {visible} or fewer, or --hostfile for several machines."]


def cpu_count_problems(processes: int, cores: int) -> list[str]:
    """--gpus N without CUDA starts N gloo processes on this machine: more than its cores and they only take turns
    on them (each with torch's threads: the run crawls, memory is N models' worth), the machine frozen meanwhile."""
    if processes <= cores:
        return []
    return [f"--gpus {processes} on CPU starts {processes} processes, and this machine gives lstune {cores} core"
            f"{'s' if cores != 1 else ''}; use --gpus {cores} or fewer, or --force to start them anyway."]


def usable_cores() -> int:
    """The cores this process may run on (its affinity, as taskset or a container's cpuset narrow it)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def launch_command(argv: list[str], gpus: int, hostfile: str | None = None, *, module: str = "lstune") -> list[str]:
    """The command that runs `python -m <module> <argv>` once per process (see the module docstring)."""
    problems = ParallelSection(gpus=gpus, hostfile=hostfile).problems()
    if problems:
        raise ConfigError(problems)
    if hostfile is not None:
        return [
            sys.executable, "-m", "deepspeed.launcher.runner", "--hostfile", hostfile, "--num_gpus", str(gpus),
            "--module", module, *argv,
        ]
    return [
        *module_entry("lstune.parallel.agent"), "--standalone", "--nproc-per-node", str(gpus), "--no-python",
        *module_entry(module), *argv,
    ]


def module_entry(module: str) -> list[str]:
    """A Python command that runs `module` as `__main__` (like `python -m`) with the folder holding this lstune
    first on sys.path in place of the working directory, so a folder named `lstune` in the directory the user
    runs from is never imported instead."""
    root = str(Path(__file__).resolve().parents[2])  # the folder holding lstune/
    code = (f"import runpy, sys; sys.path[0] = {root!r}; "
            f"runpy.run_module({module!r}, run_name='__main__', alter_sys=True)")
    return [sys.executable, "-c", code]


def relaunch(argv: list[str], gpus: int, hostfile: str | None = None, *, module: str = "lstune",
             force: bool = False) -> int:
    """Re-run `lstune <argv>` (argv without the program name) in `gpus` processes per node; their exit code.

    Without CUDA the processes run on CPU with gloo, at most one per core unless `force`. The children see the launcher's environment, so
    `detect_launch_env` is not None there and they run instead of relaunching.
    """
    env = dict(os.environ)
    # Through the environment, not torchrun's --shutdown-timeout flag, which older torch releases do not take (they
    # keep their 30 s); a value the user set wins.
    env.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", str(SHUTDOWN_TIMEOUT_S))
    if not _cuda_available():
        if hostfile is not None:
            raise ConfigError(["--hostfile needs CUDA GPUs on every node; on CPU use --gpus N on one machine."])
        problems = [] if force else cpu_count_problems(gpus, usable_cores())
        if problems:
            raise ConfigError(problems)
        env["DS_ACCELERATOR"] = "cpu"
    elif hostfile is None:
        import torch

        problems = gpu_count_problems(gpus, torch.cuda.device_count())
        if problems:
            raise ConfigError(problems)
    command = launch_command(argv, gpus, hostfile, module=module)
    # The launcher ends with this process, even one killed with -9: SIGTERM, which it passes on to the ranks (which
    # save a checkpoint and end, lstune.parallel.lifetime).
    process = subprocess.Popen(command, env=env, preexec_fn=preexec(signal.SIGTERM))
    with _passing_signals_to(process):
        return process.wait()


@contextmanager
def _passing_signals_to(process: subprocess.Popen) -> Iterator[None]:
    """While `process` (the launcher) runs: SIGTERM and SIGHUP are passed to it (it passes them to the ranks, which save a
    checkpoint), and SIGINT is ignored here — a Ctrl-C reaches every process of the terminal's group, the ranks
    included, and this process must wait for them to save rather than end (or kill the launcher) at once."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {
        sig: signal.signal(sig, lambda signum, frame: process.send_signal(signum))
        for sig in (signal.SIGTERM, signal.SIGHUP)
    }
    previous[signal.SIGINT] = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def init_distributed(env: LaunchEnv | None) -> None:
    """Join the launched run's process group (NCCL on CUDA, gloo otherwise); nothing for a single process."""
    if env is not None:
        from lstune.parallel.comm import init_process_group

        init_process_group(env)
