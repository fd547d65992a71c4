"""Every trial in a fresh process, under a time limit and a host-memory cap, so that an out-of-memory error,
a crash or a hang in one trial cannot poison the next.

One process: forked from a `multiprocessing` forkserver that imported torch, transformers and lstune once
(a trial then starts in a fraction of a second instead of the ~10 s those imports take; a few seconds on CUDA
where bitsandbytes is installed, `preload_modules`); the forkserver never initialises CUDA
(PYTORCH_NVML_BASED_CUDA_CHECK=1 keeps import-time availability checks from doing it, and bitsandbytes, which does
it anyway, is left out), so each trial gets a clean device and its own CUDA context. Several processes
(`--gpus N`): `python -m lstune.bench.trial` under the launcher `lstune train` uses (lstune.parallel.launch).

While a trial runs, the parent samples the resident memory of the trial's process tree (Linux /proc) every
`poll_s`; past `max_host_mem` it kills the tree (every process of it, by pid) and records "host-oom". The
trial's own peak RSS (getrusage) is checked against the cap afterwards too, since sampling can miss a short
peak. Past `timeout_s` the tree is killed and the trial recorded as "timeout"; a process that dies without
writing its record (the kernel's OOM killer, a segfault) is a "crash". Each trial's log (its stdout and
stderr) and record are kept in `workdir`, each name passed to `claim` before it is created (the bench's output
folder records it as the bench's: lstune.bench.outputs).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from lstune.bench.outputs import open_new_log
from lstune.train.atomic import write_text_new

# lstune.bench.trial first: it quiets a warning peft's import of bitsandbytes would print (models.quant).
PRELOAD = ["lstune.bench.trial", "torch", "transformers", "peft", "lstune.train.run", "lstune.train.prepare",
           "lstune.train.step", "lstune.memory.apply", "lstune.models.attention", "lstune.estimate"]

PAGE = os.sysconf("SC_PAGE_SIZE")


def preload_modules(cuda: bool) -> list[str]:
    """PRELOAD, without peft for trials on CUDA where bitsandbytes is installed: peft imports it, and its import asks
    every GPU's compute capability, which initialises CUDA in the forkserver whatever PYTORCH_NVML_BASED_CUDA_CHECK
    says; every forked trial then failed with "Cannot re-initialize CUDA in forked subprocess" (the H200 of
    2026-11-26). Each trial imports peft itself then (a second or few)."""
    import importlib.util

    if not cuda or importlib.util.find_spec("bitsandbytes") is None:
        return list(PRELOAD)
    return [name for name in PRELOAD if name != "peft"]


@dataclass(frozen=True)
class Limits:
    timeout_s: float
    max_host_mem: int | None  # bytes of RSS over the trial's processes; None: no cap


class TrialRunner:
    """Runs `lstune.bench.trial.Job`s one at a time; `on_tick(job, elapsed_s, rss_bytes)` is called about twice
    a second while one runs (the CLI's live display); `claim(*paths)` is told of every path before it is created."""

    def __init__(self, limits: Limits, workdir: Path, *, cuda: bool, on_tick: Callable | None = None,
                 poll_s: float = 0.05, claim: Callable[..., None] = lambda *paths: None):
        self.limits, self.workdir, self.cuda, self.on_tick, self.poll_s = limits, workdir, cuda, on_tick, poll_s
        self.claim = claim
        self._context = None

    def run(self, job) -> dict[str, Any]:
        result_path, log_path = self._paths(job)
        result_path.unlink(missing_ok=True)
        start = time.monotonic()
        process = self._start(job, result_path, log_path)
        try:
            stopped, peak_rss = self._watch(process, job, start)
        except BaseException:  # SIGTERM or Ctrl-C to the bench: its trial goes with it, not left holding the GPU
            process.kill()
            raise
        record = _read(result_path)
        if stopped is not None:
            record = {**record, **stopped}
        elif not record:
            code = process.exit_code()
            reason = f"killed by {signal.Signals(-code).name}" if code is not None and code < 0 else f"exit code {code}"
            record = {"outcome": "crash", "error": f"the trial's process ended without a result ({reason}); "
                                                   f"see {log_path}"}
        record["peak_rss_sampled"] = peak_rss
        self._check_cap(record)
        record.update(id=job.id, kind=job.kind, rung=job.rung, seq_len=job.seq_len, purpose=job.purpose,
                      processes=job.processes, wall_s=time.monotonic() - start, log=str(log_path))
        write_text_new(result_path, json.dumps(record, default=str))
        return record

    def _paths(self, job) -> tuple[Path, Path]:
        """Trial `job`'s record and log (and job file, for the launcher), claimed, in the created `workdir`.
        These names are lstune.bench.outputs.TRIAL_FILE's."""
        result_path, log_path = self.workdir / f"trial-{job.id}.json", self.workdir / f"trial-{job.id}.log"
        launched = [job_path(result_path)] if job.processes > 1 else []
        self.claim(self.workdir, result_path, log_path, *launched)
        self.workdir.mkdir(parents=True, exist_ok=True)
        return result_path, log_path

    def _check_cap(self, record: dict[str, Any]) -> None:
        cap = self.limits.max_host_mem
        peak = max(record.get("peak_rss") or 0, record.get("peak_rss_sampled") or 0)
        if cap is not None and record.get("outcome") == "ok" and peak > cap:
            record.update(outcome="host-oom", error=f"peak RSS {peak:,} B passed --max-host-mem {cap:,} B")

    def _start(self, job, result_path: Path, log_path: Path) -> "_Process":
        if job.processes > 1:
            return _Launched.start(job, result_path, log_path, self.cuda)
        if self._context is None:
            import multiprocessing

            # Imports that ask torch.cuda.is_available() (bitsandbytes, via peft) would initialise the CUDA driver
            # in the forkserver, and a driver initialised before fork() cannot be used in the child; the NVML-based
            # check answers without initialising it. The forkserver and the trials inherit this environment.
            os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
            self._context = multiprocessing.get_context("forkserver")
            self._context.set_forkserver_preload(preload_modules(self.cuda))
        process = self._context.Process(target=_child, args=(job, str(result_path), str(log_path), os.getpid()),
                                        daemon=False)
        process.start()
        return _Forked(process)

    def _watch(self, process: "_Process", job, start: float) -> tuple[dict[str, Any] | None, int]:
        """Wait for the trial; stop it past the time limit or the memory cap. (what stopped it or None, peak RSS)"""
        peak, last_tick = 0, 0.0
        while process.exit_code() is None:
            elapsed = time.monotonic() - start
            rss = tree_rss(process.pid)
            peak = max(peak, rss)
            cap = self.limits.max_host_mem
            if cap is not None and rss > cap:
                process.kill()
                return {"outcome": "host-oom", "error": f"RSS {rss:,} B passed --max-host-mem {cap:,} B; stopped"}, peak
            if elapsed > self.limits.timeout_s:
                process.kill()
                return {"outcome": "timeout", "error": f"no result within --trial-timeout {self.limits.timeout_s:g} s; "
                                                       "stopped"}, peak
            if self.on_tick is not None and elapsed - last_tick >= 0.5:
                last_tick = elapsed
                self.on_tick(job, elapsed, rss)
            time.sleep(self.poll_s)
        return None, peak


def _child(job, result_path: str, log_path: str, bench_pid: int) -> None:
    """A forked trial's body: its output goes to its log, not over the parent's display. It ends with the bench
    (`bench_pid`): a bench killed with -9 leaves no trial running unwatched (and the forkserver, which lives as long
    as a trial holds its pipe, then ends too)."""
    from lstune.parallel.lifetime import end_with

    end_with(bench_pid)
    fd = open_new_log(Path(log_path))
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    from lstune.bench.trial import run_to_file

    run_to_file(job, result_path)


class _Process:
    pid: int

    def exit_code(self) -> int | None: ...

    def kill(self) -> None:
        """SIGKILL to every process of the tree, children first (by pid: nothing else is touched)."""
        for pid in reversed(descendants(self.pid)):
            _kill(pid)
        _kill(self.pid)
        self.wait()

    def wait(self) -> None: ...


class _Forked(_Process):
    def __init__(self, process):
        self.process, self.pid = process, process.pid

    def exit_code(self) -> int | None:
        return self.process.exitcode

    def wait(self) -> None:
        self.process.join(timeout=30)


class _Launched(_Process):
    def __init__(self, popen: subprocess.Popen):
        self.popen, self.pid = popen, popen.pid

    @classmethod
    def start(cls, job, result_path: Path, log_path: Path, cuda: bool) -> "_Launched":
        from lstune.parallel.launch import launch_command
        from lstune.parallel.lifetime import preexec

        job_file = write_text_new(job_path(result_path), json.dumps(job.to_dict()))
        env = dict(os.environ)
        if not cuda:
            env["DS_ACCELERATOR"] = "cpu"
        command = launch_command([str(job_file), str(result_path)], job.processes, job.config.get("hostfile"),
                                 module="lstune.bench.trial")
        with os.fdopen(open_new_log(log_path), "w") as log:
            return cls(subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT,
                                        preexec_fn=preexec(signal.SIGKILL)))  # ends with the bench

    def exit_code(self) -> int | None:
        return self.popen.poll()

    def wait(self) -> None:
        try:
            self.popen.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass


def job_path(result_path: Path) -> Path:
    """Where a launched trial's job is written for its processes to read: trial-N.job.json."""
    return result_path.with_suffix(".job.json")


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (Linux /proc), parents before their children."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(parent, []).append(int(entry))
    found, queue = [], [pid]
    while queue:
        for child in children.get(queue.pop(0), []):
            found.append(child)
            queue.append(child)
    return found


def tree_rss(pid: int) -> int:
    """Resident bytes of `pid` and its descendants now (0 for a process that has gone)."""
    total = 0
    for p in [pid, *descendants(pid)]:
        try:
            with open(f"/proc/{p}/statm") as f:
                total += int(f.read().split()[1]) * PAGE
        except (OSError, IndexError, ValueError):
            continue
    return total


def _read(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
