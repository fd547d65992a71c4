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


def test_a_process_can_train_under_deepspeed_again_after_closing_its_group(tmp_path, monkeypatch):
    """The CLI ends the group after `train` (here a one-process ZeRO-3 group); through DeepSpeed, so that the groups
    DeepSpeed derived and keeps go too and a second engine in the same process (the CLI run in-process again)
    builds fresh ones — destroying torch's group alone left it a stale data-parallel group."""
    import torch.distributed as dist

    from lstune.config.schema import TrainConfig
    from lstune.parallel.comm import close_process_group
    from lstune.parallel.launch import detect_launch_env
    from lstune.train.run import train

    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):  # the one-process group sets them; gone again after the test
        monkeypatch.delenv(name, raising=False)
    losses = []
    for run in range(2):
        config = TrainConfig.from_flat({"model": "tiny-llama", "data": "builtin:passkey", "seq_len": 256, "max_steps": 1,
                                        "zero_stage": 3, "max_records": 4, "output_dir": str(tmp_path / f"r{run}")})
        losses.append(train(config).history[-1]["loss"])
        close_process_group()
        # No group, and not the look of a launched rank (the one-process group's RANK/WORLD_SIZE are gone):
        # else the second run joined by env:// on port 29500 and left a store listening there, on which
        # every later trial process of the test session failed.
        assert not dist.is_initialized() and detect_launch_env() is None
    assert losses[0] == losses[1]
