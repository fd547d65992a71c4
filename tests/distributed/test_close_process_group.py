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


def _train_twice(root: str) -> None:
    import os

    import torch.distributed as dist

    from lstune.config.schema import TrainConfig
    from lstune.parallel.comm import close_process_group
    from lstune.parallel.launch import detect_launch_env
    from lstune.train.run import train

    os.environ["DS_ACCELERATOR"] = "cpu"
    report = {"losses": [], "closed": []}
    for run in range(2):
        config = TrainConfig.from_flat({"model": "tiny-llama", "data": "builtin:passkey", "seq_len": 256, "max_steps": 1,
                                        "zero_stage": 3, "max_records": 4, "output_dir": f"{root}/r{run}"})
        report["losses"].append(train(config).history[-1]["loss"])
        close_process_group()
        report["closed"].append(not dist.is_initialized() and detect_launch_env() is None)
    (Path(root) / "report.json").write_text(json.dumps(report))


def test_a_process_can_train_under_deepspeed_again_after_closing_its_group(tmp_path):
    """The CLI ends the group after `train` (here a one-process ZeRO-3 group); through DeepSpeed, so that the groups
    DeepSpeed derived and keeps go too and a second engine in the same process (the CLI run in-process again)
    builds fresh ones — destroying torch's group alone left it a stale data-parallel group. Nor does the process
    look like a launched rank afterwards (the one-process group's RANK/WORLD_SIZE are gone): else the second run
    joined by env:// on port 29500 and left a store listening there. In a process of its own: ZeRO-3 replaces
    torch's linear function for the rest of the process."""
    process = multiprocessing.get_context("spawn").Process(target=_train_twice, args=(str(tmp_path),))
    process.start()
    process.join(timeout=300)
    assert process.exitcode == 0
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["closed"] == [True, True] and report["losses"][0] == report["losses"][1]
