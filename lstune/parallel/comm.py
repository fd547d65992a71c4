"""The few collectives lstune runs outside the model, and joining a process group — one home for both.

`Communicator` answers rank and size in one process group (the world by default; `ParallelDims` hands
out its SP and DP ones) and runs sum, any, barrier, gather and broadcast of small values there. A single
process (torch.distributed not initialised) gets a communicator of size 1 whose calls need no messages,
so the runtime, checkpoints, the loss and export run unchanged with or without a launcher.
Tensor collectives inside the model (Ulysses all-to-alls, the SP data scatter) stay with their code.

`init_process_group` is the one place a process group is created: joining a launched run, or a
one-process group where DeepSpeed needs one on a single device. `close_process_group` ends it before a process
exits: one that exits with a gloo group alive can abort in the interpreter's teardown (SIGABRT, "terminate called
without an active exception"), turning a finished run's exit code 0 into -6. Only the process's owner (the CLI
command, a bench trial) calls it, when every rank is done.
"""

from __future__ import annotations

import os
import socket
import sys
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

from lstune.errors import UserError

T = TypeVar("T")


@dataclass(frozen=True)
class Communicator:
    """Collectives over one process group (`group` None = the world) seen from this rank."""

    rank: int = 0
    size: int = 1
    group: Any = None

    @classmethod
    def of(cls, group: Any = None) -> "Communicator":
        """`group` (None: the world) when torch.distributed is initialised, else this process alone."""
        if process_group_ready():
            import torch.distributed as dist

            return cls(dist.get_rank(group), dist.get_world_size(group), group)
        if group is not None:
            raise ValueError("a process group was given but torch.distributed is not initialised")
        return cls()

    def sum(self, values: list[float]) -> list[float]:
        """Element-wise sum over the group's ranks (float64); the values themselves on a single process."""
        if self.size == 1:
            return [float(v) for v in values]
        import torch
        import torch.distributed as dist

        device = torch.cuda.current_device() if dist.get_backend(self.group) == "nccl" else "cpu"
        tensor = torch.tensor(values, dtype=torch.float64, device=device)
        dist.all_reduce(tensor, group=self.group)
        return tensor.cpu().tolist()

    def any(self, flag: bool) -> bool:
        """True on every rank when `flag` is true on any of them."""
        return self.sum([1.0 if flag else 0.0])[0] > 0

    def agreed(self, check: Callable[[], T]) -> T:
        """`check()` on every rank of the group, all of them ending alike: its result where no rank's check raised a
        UserError, else a UserError on every rank — the lowest refusing rank's own (its message, printed), a quiet
        one of the same kind and message on the others (callers that catch it by kind see it alike). For a check
        that sees only this rank's share (its sequence shard, its batch) before a collective that would otherwise
        wait for a rank that left. Every rank of the group must call it at the same point; one flag (an all-reduce)
        when all pass, the messages only when not."""
        error = None
        try:
            result = check()
        except UserError as exc:
            error = exc
        if not self.any(error is not None):
            return result
        reports = self.gather(None if error is None else (type(error), str(error), error.problems))
        first = next(rank for rank, report in enumerate(reports) if report is not None)
        if first == self.rank:
            raise error
        raise _quiet(*reports[first]) from error

    def barrier(self) -> None:
        if self.size > 1:
            import torch.distributed as dist

            dist.barrier(group=self.group)

    def gather(self, obj: Any) -> list:
        """Every rank's `obj` (picklable), in group rank order, on every rank."""
        if self.size == 1:
            return [obj]
        import torch.distributed as dist

        gathered: list = [None] * self.size
        dist.all_gather_object(gathered, obj, group=self.group)
        return gathered

    def broadcast(self, obj: Any) -> Any:
        """The group's rank 0's `obj` (picklable), on every rank."""
        if self.size == 1:
            return obj
        import torch.distributed as dist

        box = [obj]
        source = 0 if self.group is None else dist.get_global_rank(self.group, 0)
        dist.broadcast_object_list(box, src=source, group=self.group)
        return box[0]


def _quiet(kind: type, message: str, problems: list[str]) -> UserError:
    """Another rank's user error as this rank raises it: the same kind, message and problems, and quiet (the CLI
    exits with its code without printing it again)."""
    error = kind.__new__(kind)  # not kind(...): a kind's own constructor may build the message (ConfigError)
    UserError.__init__(error, message, problems=problems)
    error.quiet = True
    return error


# The environment variables init_process_group set for a one-process group (close_process_group removes them).
_ENV_SET: list[str] = []


def process_group_ready() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def init_process_group(launch: Any = None) -> None:
    """Join the launched run (`launch`, a LaunchEnv), or start a one-process group when there is none:
    DeepSpeed needs a group even on one device (ZeRO-3 with host offload is how one GPU trains a model
    whose Adam state does not fit). NCCL on CUDA, gloo otherwise; nothing if a group exists already."""
    import torch
    import torch.distributed as dist

    if process_group_ready():
        return
    if torch.cuda.is_available():
        if launch is not None:
            torch.cuda.set_device(launch.local_rank)
        backend = "nccl"
    else:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        backend = "gloo"
    if launch is None:
        # Ranks for libraries that read them from the environment (DeepSpeed's local rank), removed again by
        # close_process_group: left behind, they would make this process look like a launched rank to a later
        # run in it (detect_launch_env) and to the processes it starts. The group itself gets a fresh local port,
        # so a process can start one again after destroying the last.
        for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
            if name not in os.environ:
                os.environ[name] = value
                _ENV_SET.append(name)
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
        return
    # env:// with the launcher's variables: under torchrun it joins the agent's store instead of opening
    # a second one on MASTER_PORT. MPI launchers name them differently, so fill in the torch names.
    for name, value in (("RANK", launch.rank), ("WORLD_SIZE", launch.world_size), ("LOCAL_RANK", launch.local_rank),
                        ("MASTER_ADDR", launch.master_addr), ("MASTER_PORT", launch.master_port)):
        os.environ.setdefault(name, str(value))
    dist.init_process_group(backend, init_method="env://")


def close_process_group() -> None:
    """All ranks meet at a barrier, so none tears its group down while another still talks to it, then each
    destroys its process group; nothing without one. Every rank of the group must call it."""
    if not process_group_ready():
        return
    import torch.distributed as dist

    dist.barrier()
    deepspeed_comm = sys.modules.get("deepspeed.comm.comm")  # where DeepSpeed keeps its backend (`cdb`)
    if deepspeed_comm is not None and getattr(deepspeed_comm, "cdb", None) is not None:
        # Through DeepSpeed when it wraps the group: it also drops the groups it derived and keeps (its data-parallel
        # group and others), which a later engine in this process would otherwise find destroyed.
        deepspeed_comm.destroy_process_group()
    else:
        dist.destroy_process_group()
    while _ENV_SET:
        os.environ.pop(_ENV_SET.pop(), None)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
