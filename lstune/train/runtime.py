"""Where this process runs: device, precision, and its place in a distributed run.

A single process and a launched rank look the same to the loop: `Runtime` answers rank, world size and
"am I the main process", runs the few collectives the loop needs (barrier, sums, "did any rank get a
stop signal") through the world's `Communicator`, and owns the `ParallelDims` once the model's heads
are known.
"""

from __future__ import annotations

import os
import warnings
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from typing import Any, Iterator


@dataclass
class Runtime:
    device: Any  # torch.device
    autocast_dtype: Any  # torch.bfloat16 or None (fp32)
    launch: Any = None  # lstune.parallel.launch.LaunchEnv, None for a plain single process
    dims: Any = None  # lstune.parallel.dims.ParallelDims, set by `set_dims`
    notes: list = field(default_factory=list)  # what the user should know about the setup (threads chosen)

    @property
    def distributed(self) -> bool:
        return self.launch is not None

    @property
    def rank(self) -> int:
        return self.launch.rank if self.launch else 0

    @property
    def world_size(self) -> int:
        return self.launch.world_size if self.launch else 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def sp(self) -> int:
        return self.dims.sp if self.dims is not None else 1

    def set_dims(self, sp: Any, model_config: Any, ring: Any = 1) -> None:
        """Split the world into DP × SP (SP = Ulysses × `ring`) for this model's heads (ConfigError lists valid
        degrees)."""
        from lstune.parallel.dims import ParallelDims

        node = getattr(self.launch, "local_world_size", None)
        self.use_dims(ParallelDims.for_model(self.world_size, sp, model_config, ring=ring, node_size=node))

    def use_dims(self, dims: Any) -> None:
        """Take a layout already made (a RunPlan's, lstune.train.plan); its groups are built once there is a
        process group."""
        from lstune.parallel.comm import process_group_ready

        if dims.world_size != self.world_size:
            raise ValueError(f"the plan is laid out for {dims.world_size} processes; this run has {self.world_size}")
        self.dims = dims
        if process_group_ready():
            self.dims.build_groups()

    def layout(self, metp_mlp: bool = False, attn_chunks: str | int = "off") -> dict:
        """The parallel layout a checkpoint records and a resume must match (`layout_of`)."""
        return layout_of(self.world_size, self.dims, metp_mlp, attn_chunks)

    @property
    def comm(self):
        """The world's communicator (lstune.parallel.comm): size 1 until a process group exists."""
        from lstune.parallel.comm import Communicator

        return Communicator.of()

    def ensure_process_group(self) -> None:
        """DeepSpeed needs a process group even for one process (ZeRO offload on a single GPU)."""
        from lstune.parallel.comm import init_process_group, process_group_ready

        if process_group_ready():
            return
        init_process_group(self.launch)
        if self.dims is not None:
            self.dims.build_groups()

    def barrier(self) -> None:
        self.comm.barrier()

    def sum(self, values: list[float]) -> list[float]:
        """Element-wise sum over all ranks (float64); the values themselves on a single process."""
        return self.comm.sum(values)

    def any(self, flag: bool) -> bool:
        return self.comm.any(flag)

    @contextmanager
    def decided_alike(self) -> Iterator[None]:
        """A block whose user errors every rank raises alike (checks of the config, the model's config and rank 0's
        broadcast estimate): the main process reports it; the others stop quietly (PeerFailed), so that N processes
        do not print the same message N times. `--debug` prints every rank's."""
        from lstune.errors import PeerFailed, UserError

        try:
            yield
        except UserError as exc:
            if self.is_main or exc.quiet:
                raise
            raise PeerFailed(f"stopped on the main process's error: {exc}", problems=exc.problems) from exc

    @contextmanager
    def main_first(self) -> Iterator[None]:
        """The main process runs the block first (e.g. filling a cache), then the others. When it fails there (bad
        data), it tells the others, which stop quietly (PeerFailed) instead of waiting on a peer that is gone (a
        connection error and a traceback from each) — its own message is the one the user sees."""
        if not self.is_main:
            if self.any(False):
                from lstune.errors import PeerFailed

                raise PeerFailed("stopped: the main process failed first (its message says why)")
            yield
            return
        try:
            yield
        except BaseException:
            with suppress(Exception):  # a peer already gone: the error at hand is the one to report
                self.any(True)
            raise
        self.any(False)


def start_runtime(dtype: str) -> Runtime:
    """Join the launched run if there is one; pick the device and the autocast dtype."""
    import torch

    from lstune.parallel.launch import detect_launch_env, init_distributed

    if torch.cuda.is_available():
        from lstune.memory.allocator import ensure_expandable_segments

        ensure_expandable_segments()  # before anything initialises CUDA's allocator
    else:
        # DeepSpeed gets imported on the way (accelerate imports it to unwrap models); told the accelerator,
        # it does not warn that it "was unable to detect" one.
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    launch = detect_launch_env()
    init_distributed(launch)
    # DeepSpeed's ZeRO calls torch.distributed collectives that torch deprecates, warning every step.
    warnings.filterwarnings("ignore", message=r".*(all_gather_into_tensor|reduce_scatter_tensor).* is deprecated",
                            category=FutureWarning)
    # DeepSpeed's barriers on NCCL without a bound device_id: torch picks the current device, which set_device below
    # made the rank's own (seen on the H200, 2026-11-26, in every ZeRO-3 run).
    warnings.filterwarnings("ignore", message=r"barrier\(\): using the device under current context",
                            category=UserWarning)
    if torch.cuda.is_available():
        index = launch.local_rank if launch else torch.cuda.current_device()
        torch.cuda.set_device(index)
        return Runtime(torch.device("cuda", index), None if dtype == "fp32" else torch.bfloat16, launch)
    runtime = Runtime(torch.device("cpu"), torch.bfloat16 if dtype == "bf16" else None, launch)
    runtime.notes.append(set_cpu_threads(launch.local_world_size if launch else 1))
    return runtime


def set_cpu_threads(local_processes: int) -> str:
    """One share of this machine's cores per local process, unless OMP_NUM_THREADS says otherwise.

    torch's default (every core in each process) oversubscribes the cores as soon as two processes share
    a machine, and a CPU run then spends its time switching threads (10-20× slower measured on 2 busy cores)."""
    import torch

    chosen = os.environ.get("OMP_NUM_THREADS", "").strip()
    if chosen.isdigit() and int(chosen) > 0:
        torch.set_num_threads(int(chosen))
        return f"CPU threads per process: {chosen} (OMP_NUM_THREADS)"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = max(1, cores // max(1, local_processes))
    torch.set_num_threads(threads)
    return (f"CPU threads per process: {threads} ({cores} cores ÷ {local_processes} local process"
            f"{'es' if local_processes != 1 else ''}; set OMP_NUM_THREADS to choose)")


def layout_of(world_size: int, dims: Any, metp_mlp: bool = False, attn_chunks: str | int = "off") -> dict:
    """The parallel layout a checkpoint records and a resume must match (lstune.train.preflight.check_resume_layout):
    a launched rank's (`Runtime.layout`) and, before launch, the parent's from the plan's dims (lstune.train.plan).
    Under a ring with chunked attention also `--attn-chunks`: its chunks cut the zigzag pieces
    (lstune.models.chunk_layout), so they decide which tokens each rank holds (recorded only then: older checkpoints
    keep matching)."""
    ring = dims.ring if dims is not None else 1
    sp = dims.sp if dims is not None else 1
    layout = {"world_size": world_size, "sp": sp, "ring": ring, "metp_mlp": bool(metp_mlp)}
    if ring > 1 and attn_chunks != "off":
        layout["attn_chunks"] = attn_chunks
    return layout
