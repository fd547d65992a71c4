"""Per-step metrics: memory readings and the metrics.jsonl writer."""

from __future__ import annotations

import json
import os
import resource
from pathlib import Path
from typing import Any

METRICS_FILE = "metrics.jsonl"


def host_rss_bytes() -> int:
    """Resident set size of this process now (Linux /proc; falls back to the peak elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return host_peak_rss_bytes()


def host_peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def peak_device_mem_bytes(device) -> int:
    """Peak allocated memory on `device` since the last reset; on CPU the process's peak RSS."""
    import torch

    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return host_peak_rss_bytes()


def reset_peak(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


class MetricsWriter:
    """Appends one JSON object per optimizer step to OUTPUT_DIR/metrics.jsonl, flushed each line so a
    crash loses nothing. On resume, lines for steps after the checkpoint are dropped first, so the file
    always describes one consistent history."""

    def __init__(self, output_dir: Path, *, resume_step: int | None = None):
        self.path = output_dir / METRICS_FILE
        if resume_step is not None and self.path.exists():
            self._truncate_after(resume_step)
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | getattr(os, "O_NOFOLLOW", 0), 0o644)
        self._file = os.fdopen(fd, "a", encoding="utf-8")

    def _truncate_after(self, step: int) -> None:
        kept = []
        for line in self.path.read_text(encoding="utf-8").splitlines():
            try:
                if json.loads(line).get("step", 0) <= step:
                    kept.append(line)
            except json.JSONDecodeError:
                continue  # a line cut by a crash
        tmp = self.path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(f"{line}\n" for line in kept), encoding="utf-8")
        os.replace(tmp, self.path)

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()
