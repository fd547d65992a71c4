"""`close_process_group`: every rank waits for the others before its group ends, then none has a group left.

A rank that ended its group (or exited with it alive) while another still used it is what aborted a finished
`lstune train --gpus 2` in its teardown (SIGABRT instead of exit code 0)."""

from __future__ import annotations

import json
import multiprocessing
import time
from pathlib import Path


def _worker(rank: int, root: str) -> None:
    import torch.distributed as dist

    from lstune.parallel.comm import close_process_group, process_group_ready

    dist.init_process_group("gloo", init_method=f"file://{root}/rendezvous", rank=rank, world_size=2)
    if rank == 0:
        time.sleep(2.0)  # still busy (a plot, a summary) while rank 1 is done
    start = time.monotonic()
    close_process_group()
    waited = time.monotonic() - start
    close_process_group()  # without a group: nothing to do
    (Path(root) / f"rank{rank}.json").write_text(json.dumps({"waited": waited, "ready": process_group_ready()}))


def test_ranks_wait_for_each_other_then_have_no_group(tmp_path):
    context = multiprocessing.get_context("spawn")
    ranks = [context.Process(target=_worker, args=(rank, str(tmp_path))) for rank in range(2)]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join(timeout=120)
    assert [process.exitcode for process in ranks] == [0, 0]
    reports = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    assert not any(report["ready"] for report in reports)
    assert reports[1]["waited"] > 1.0  # rank 1 did not end its group while rank 0 was still busy
