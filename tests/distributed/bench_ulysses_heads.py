"""Overhead of uneven head partitions vs even ones: time and bytes of one Ulysses attention (fwd + bwd).

    python -m tests.distributed.bench_ulysses_heads [--world 4] [--seq 4096] [--reps 5]

Runs in `world` gloo CPU processes (the same code path as on GPUs, with gloo instead of NCCL and CPU SDPA
as the kernel), for even and uneven head counts, and prints per configuration: heads per rank, the
median time of forward + backward, the elements each rank sends in forward (q, k, v, output; backward
sends the same again), and the time per q head normalised to the even case. Numbers for docs/parallel.md.
"""

from __future__ import annotations

import argparse
import json

CONFIGS = [  # (label, q heads, kv heads)
    ("even MHA 8/8", 8, 8),
    ("uneven MHA 9/9", 9, 9),
    ("padding 9 to 12 (what dummy heads would cost)", 12, 12),
    ("even GQA 8/2", 8, 2),
    ("uneven GQA 6/2", 6, 2),
    ("uneven GQA 10/2", 10, 2),
]


def _bench(rank: int, world: int, seq: int, reps: int, head_dim: int) -> list[dict]:
    import statistics
    import time

    import torch
    import torch.distributed as dist

    from lstune.models.attention import lstune_attention_forward
    from lstune.parallel.dims import ParallelDims
    from lstune.parallel.ulysses import UlyssesAttention

    torch.set_num_threads(1)
    dims = ParallelDims(world, world).build_groups()
    local = seq // world
    positions = torch.arange(seq)[None, rank * local : (rank + 1) * local]
    rows = []
    for label, q_heads, kv_heads in CONFIGS:
        attention = UlyssesAttention(lstune_attention_forward, "lstune", dims)
        plan = attention.plan(q_heads, kv_heads)
        module = type("M", (), {"is_causal": True, "training": True})()
        times = []
        for _ in range(reps + 1):
            q = torch.randn(1, q_heads, local, head_dim, requires_grad=True)
            k = torch.randn(1, kv_heads, local, head_dim, requires_grad=True)
            v = torch.randn(1, kv_heads, local, head_dim, requires_grad=True)
            attention._positions_in = None
            dist.barrier()
            start = time.perf_counter()
            out, _ = attention(module, q, k, v, None, position_ids=positions, scaling=head_dim**-0.5)
            out.sum().backward()
            dist.barrier()
            times.append(time.perf_counter() - start)
        rows.append({
            "config": label, "q_heads": q_heads, "kv_heads": kv_heads, "q_per_rank": list(plan.q_counts),
            "kv_per_rank": list(plan.kv_counts), "seconds": statistics.median(times[1:]),
            "elements_sent_per_rank": plan.elements_sent(1, local, head_dim),
        })
    return rows


def main() -> None:
    from tests.support.distributed import run_distributed

    parser = argparse.ArgumentParser()
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--head-dim", type=int, default=64)
    args = parser.parse_args()
    rows = run_distributed(_bench, args.world, args.seq, args.reps, args.head_dim, timeout=1800)[0]
    base = {"MHA": rows[0], "GQA": rows[3]}
    for row in rows:
        even = base["GQA" if "GQA" in row["config"] else "MHA"]
        per_head = (row["seconds"] / row["q_heads"]) / (even["seconds"] / even["q_heads"])
        row["time_per_q_head_vs_even"] = round(per_head, 3)
    print(json.dumps({"world": args.world, "seq": args.seq, "head_dim": args.head_dim, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
