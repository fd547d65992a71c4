"""Run a function in N gloo processes on CPU, the way `torchrun` would, and collect what each returns.

`DistributedPool(world_size)` keeps N such processes alive and runs `pool.run(fn, *args)` in all of them:
the tests share it, so the 10–20 s each process spends importing torch and transformers on 2 cores is
paid once per session instead of once per test. A task that fails or hangs shuts the pool down (its
ranks may be stuck in a collective) and the next task starts a fresh one.

`run_distributed(fn, world_size, *args)` spawns `world_size` fresh Python processes (spawn, not fork:
the parent may already hold threads and a torch runtime), gives each the launcher environment (RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT on a free port, DS_ACCELERATOR=cpu), one torch thread and an
initialised gloo process group, runs `fn(rank, world_size, *args)` and returns the per-rank results
(anything torch.save can write). An exception in any rank fails the call with that rank's traceback; a
run past `timeout` seconds is killed and fails. `fn` must be importable (a module-level function).
"""

from __future__ import annotations

import os
import queue
import socket
import traceback
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launcher_env(rank: int, world_size: int, port: int) -> dict[str, str]:
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }


@contextmanager
def _env(**values: str):
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _worker(rank: int, fn: Callable, world_size: int, port: int, out_dir: str, args: tuple) -> None:
    os.environ.update(launcher_env(rank, world_size, port))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        result = fn(rank, world_size, *args)
        torch.save(result, Path(out_dir) / f"{rank}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_distributed(fn: Callable, world_size: int, *args: Any, timeout: float = 240) -> list[Any]:
    """`[fn(0, world_size, *args), …, fn(world_size - 1, world_size, *args)]`, each in its own process."""
    import torch
    import torch.multiprocessing as mp

    port = free_port()
    with tempfile.TemporaryDirectory() as out_dir, _env(
        DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false"
    ):
        ctx = mp.start_processes(
            _worker, args=(fn, world_size, port, out_dir, args), nprocs=world_size, join=False, start_method="spawn"
        )
        deadline = time.monotonic() + timeout
        while not ctx.join(timeout=1):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    if p.is_alive():
                        p.kill()
                raise TimeoutError(f"{fn.__name__} on {world_size} processes ran past {timeout:.0f}s")
        return [torch.load(Path(out_dir) / f"{r}.pt", weights_only=False) for r in range(world_size)]


def _pool_worker(rank: int, world_size: int, port: int, tasks, results) -> None:
    os.environ.update(launcher_env(rank, world_size, port))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    while (task := tasks.get()) is not None:
        fn, args = task
        try:
            results.put((rank, True, fn(rank, world_size, *args)))
        except BaseException:  # noqa: BLE001 - the parent re-raises it with this rank's traceback
            results.put((rank, False, traceback.format_exc()))
    dist.destroy_process_group()


class DistributedPool:
    """`world_size` long-lived gloo processes; `run(fn, *args)` → per-rank results of `fn(rank, world, *args)`."""

    def __init__(self, world_size: int, timeout: float = 240):
        self.world_size = world_size
        self.timeout = timeout
        self._procs: list = []

    def _start(self) -> None:
        import torch.multiprocessing as mp

        spawn = mp.get_context("spawn")
        self._tasks = [spawn.Queue() for _ in range(self.world_size)]
        self._results = spawn.Queue()
        port = free_port()
        with _env(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false"):
            self._procs = [
                spawn.Process(target=_pool_worker, args=(r, self.world_size, port, self._tasks[r], self._results))
                for r in range(self.world_size)
            ]
            for p in self._procs:
                p.start()

    def run(self, fn: Callable, *args: Any, timeout: float | None = None) -> list[Any]:
        if not self._procs:
            self._start()
        for tasks in self._tasks:
            tasks.put((fn, args))
        deadline = time.monotonic() + (timeout or self.timeout)
        out: dict[int, Any] = {}
        while len(out) < self.world_size:
            try:
                rank, ok, value = self._results.get(timeout=max(deadline - time.monotonic(), 0.01))
            except queue.Empty:
                self.close()
                raise TimeoutError(f"{fn.__name__} on {self.world_size} processes ran past its time limit") from None
            if not ok:
                self.close()
                raise RuntimeError(f"{fn.__name__} failed on rank {rank}:\n{value}")
            out[rank] = value
        return [out[r] for r in range(self.world_size)]

    def close(self) -> None:
        """Stop the workers: politely when idle, by kill when they are stuck."""
        for tasks in getattr(self, "_tasks", []):
            tasks.put(None)
        deadline = time.monotonic() + 3
        for p in self._procs:
            p.join(timeout=max(deadline - time.monotonic(), 0.1))
            if p.is_alive():
                p.kill()
                p.join()
        self._procs = []
