"""Run by test_launch under the real launcher: join the group, all-reduce the ranks, report to a file."""

from __future__ import annotations

import json
import sys
from pathlib import Path

if __name__ == "__main__":
    import torch
    import torch.distributed as dist

    from lstune.parallel.launch import detect_launch_env, init_distributed

    env = detect_launch_env()
    init_distributed(env)
    total = torch.tensor([float(env.rank)])
    dist.all_reduce(total)
    out = Path(sys.argv[1]) / f"rank{env.rank}.json"
    out.write_text(json.dumps({"rank": env.rank, "world": env.world_size, "launcher": env.launcher,
                               "backend": dist.get_backend(), "sum": total.item(), "argv": sys.argv[2:]}))
    dist.destroy_process_group()
    sys.exit(0)
