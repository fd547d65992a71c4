"""The hardware and software a bench ran on, read without starting CUDA (the parent of the trials must not
hold a CUDA context: it would take device memory from them).

GPU name, memory and driver from `nvidia-smi`; CUDA and the library versions from the installed packages'
metadata; host RAM and cores from the OS; lstune's git commit (and whether the tree had changes) when it runs
from a git checkout.
"""

from __future__ import annotations

import os
import platform
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any

PACKAGES = ("torch", "transformers", "deepspeed", "peft", "liger-kernel", "accelerate", "flash-attn")


def fingerprint() -> dict[str, Any]:
    from lstune import __version__
    from lstune.estimate.hardware import local_host_bytes

    return {
        "gpus": gpus(),
        "cuda": _torch_cuda(),
        "host_ram_bytes": local_host_bytes(),
        "cpu_cores": os.cpu_count(),
        "cpu_cores_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "cpu": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "versions": {name: _version(name) for name in PACKAGES},
        "lstune": {"version": __version__, **git_commit()},
    }


def gpus() -> list[dict[str, Any]]:
    """One entry per GPU nvidia-smi lists (name, memory in bytes, driver); [] without one."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=20, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    found = []
    for line in out.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 3:
            name, mib, driver = parts
            found.append({"name": name, "memory_bytes": int(float(mib)) * 2**20, "driver": driver})
    return found


def _torch_cuda() -> str | None:
    """The CUDA version torch was built with (torch.version.cuda), read without importing torch when possible."""
    import sys

    torch = sys.modules.get("torch")
    if torch is not None:
        return torch.version.cuda
    try:
        spec = metadata.distribution("torch")
        version_file = Path(spec.locate_file("torch/version.py"))
        for line in version_file.read_text().splitlines():
            if line.startswith("cuda"):
                value = line.split("=", 1)[1].strip().strip("'\"")
                return None if value in ("None", "") else value
    except (metadata.PackageNotFoundError, OSError):
        pass
    return None


def _version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def git_commit() -> dict[str, Any]:
    """{"commit": sha, "dirty": bool} of the checkout lstune runs from; {} outside a git checkout."""
    root = Path(__file__).resolve().parents[2]
    try:
        sha = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=10, check=True).stdout.strip()
        status = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                                capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    return {"commit": sha, "dirty": bool(status.strip())}


def describe(fp: dict[str, Any]) -> list[str]:
    """The fingerprint as the three lines bench.md and docs/benchmarks/ print."""
    gib = 2**30
    gpu = fp["gpus"]
    device = (f"{len(gpu)} × {gpu[0]['name']}, {gpu[0]['memory_bytes'] / gib:.1f} GiB, driver {gpu[0]['driver']}, "
              f"CUDA {fp['cuda']}" if gpu else f"no GPU ({fp['cpu']})")
    v = fp["versions"]
    libs = " | ".join(f"{k} {v[k]}" for k in ("torch", "transformers", "deepspeed", "peft", "liger-kernel") if v.get(k))
    lstune = fp["lstune"]
    commit = (lstune.get("commit", "")[:10] + (" (with uncommitted changes)" if lstune.get("dirty") else "")
              if lstune.get("commit") else "not a git checkout")
    return [f"{device}; host RAM {fp['host_ram_bytes'] / gib:.0f} GiB, {fp['cpu_cores']} cores",
            f"{libs}; Python {fp['python']}", f"lstune {lstune['version']} at {commit}"]
