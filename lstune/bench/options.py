"""The bench's own options (`lstune bench --steps 3 --ablation ...`), declared like the config sections' fields.

Each field's metadata holds its help, parser and metavar (lstune.config.schema's pattern), so the CLI builds
the flags from them (lstune.cli.options.dataclass_parameters) and `parse_options` reports every bad value at
once (exit code 2). The model, data, memory, parallel and optim flags are the config sections' own: a bench
configuration is a `lstune train` configuration.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from functools import partial
from typing import Any, Callable, ClassVar

from lstune.config import parse as p

_pos_int = partial(p.parse_int, minimum=1)


def _opt(default: Any, help: str, parser: Callable[[Any], Any], **meta: Any) -> Any:
    return field(default=default, metadata={"help": help, "parser": parser, **meta})


def parse_lengths(value: Any) -> list[int]:
    """'16k,32k,64k' (or a YAML list) → [16384, 32768, 65536]: each a length, in increasing order, no repeats."""
    items = value if isinstance(value, (list, tuple)) else [s for s in str(value).split(",") if s.strip()]
    if not items:
        raise ValueError(f"is empty; give lengths like 16k,32k,64k ({p.LENGTH_HINT})")
    lengths = []
    for item in items:
        try:
            lengths.append(p.parse_length(item.strip() if isinstance(item, str) else item))
        except ValueError as exc:
            raise ValueError(f"has {str(item).strip()!r}, which {exc}") from None
    return sorted(set(lengths))


# A trial is a Python process with torch and transformers imported (~300 MiB of RSS before any model): a cap
# below this stops every trial as host-oom and measures nothing. Not 1 GiB (--device-mem's floor): the CPU
# tests cap a tiny model's trials just above their RSS (~400 MiB) to make them run out of host memory.
MIN_HOST_MEM = 256 * 2**20


def parse_host_mem(value: Any) -> int:
    """--max-host-mem: a size of at least MIN_HOST_MEM."""
    n = p.parse_bytes(value)
    if n < MIN_HOST_MEM:
        raise ValueError(f"is less than {MIN_HOST_MEM // 2**20} MiB, less than a trial's Python with torch takes "
                         "(every trial would stop at it); give e.g. 2G, or drop it for the default")
    return n


@dataclass
class BenchOptions:
    """What to measure (configurations, lengths, searches), how (steps, limits) and where the results go."""

    title: ClassVar[str] = "Bench"

    rungs: Any = _opt(
        None,
        "Configurations, comma-separated: hf, tiled_loss, tiled_mlp, offload, mini_seq, lstune (the flags), sp, "
        "sp_ulysses, sp_ring, sp_hybrid (docs/bench.md) [default: lstune; the ladder with --ablation].",
        partial(p.parse_str_list, items="rung names", auto=False,
                hint="one or more of hf, tiled_loss, tiled_mlp, offload, mini_seq, lstune, sp, sp_ulysses, sp_ring, "
                     "sp_hybrid, comma-separated"),
        metavar="NAMES",
    )
    ablation: bool = _opt(
        False,
        "ALST Table 1's ladder on this model: plain HF, + tiled loss, + tiled MLP, + offloaded checkpoints, "
        "+ mini-sequence, your flags (when they differ), + SP (with --gpus > 1).",
        p.parse_bool,
    )
    lengths: Any = _opt(
        None, "Measure each configuration at these lengths, e.g. 16k,32k,64k [default: --seq-len].",
        parse_lengths, metavar="LENGTHS",
    )
    warmup: int = _opt(1, "Untimed steps before the timed ones.", partial(p.parse_int, minimum=0), metavar="N")
    steps: int = _opt(3, "Timed steps per measurement (at least 1).", _pos_int, metavar="N")
    find_max_len: bool = _opt(
        False,
        "Search each configuration's longest sequence that completes two training steps: doubling from "
        "--seq-len, then bisecting to --len-step; every trial in a fresh process.",
        p.parse_bool,
    )
    len_step: int = _opt(8192, "Resolution of --find-max-len.", p.parse_length, metavar="LENGTH", show=p.format_length)
    max_len: int | None = _opt(
        None, "--find-max-len tries nothing longer than this (a step's time grows with the length squared).",
        p.parse_length, metavar="LENGTH",
    )
    max_host_mem: int | None = _opt(
        None,
        "Host memory a trial may use (peak RSS of its processes; at least 256M), e.g. 2G: past it the trial is "
        "stopped and counts as out of memory [default: none on CUDA; 80% of this machine's RAM on CPU].",
        parse_host_mem, metavar="BYTES",
    )
    trial_timeout: int = _opt(
        1800, "Seconds a trial may take; a trial past it is stopped and counts as failed.", _pos_int,
        metavar="SECONDS",
    )
    rates: bool = _opt(
        False, "Also measure the device's bf16 GEMM and causal attention kernel rates (the ideal step time).",
        p.parse_bool,
    )
    output_dir: str | None = _opt(
        None, "Where bench.json, bench.md and the plots go (default: runs/bench-MODEL-TIMESTAMP).",
        p.parse_optional_str, metavar="DIR",
    )
    overwrite: bool = _opt(
        False, "Replace an earlier bench's files in --output-dir (those its record lists; nothing else is touched).",
        p.parse_bool,
    )


def parse_options(raw: dict[str, Any]) -> tuple[BenchOptions, list[str]]:
    """Typed options from raw values (None = not given) and every problem found, naming the flag."""
    values, problems = {}, []
    for f in fields(BenchOptions):
        value = raw.get(f.name)
        if value is None:
            continue
        try:
            values[f.name] = f.metadata["parser"](value)
        except ValueError as exc:
            problems.append(f"--{f.name.replace('_', '-')} {str(value)!r} {exc}.")
    return BenchOptions(**values), problems
