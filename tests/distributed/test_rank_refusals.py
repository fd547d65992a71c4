"""A refusal that one rank of an SP group makes on its own share (its shard's mask check, its batch) stops every rank
of the group alike before the next collective: the refusing rank raises its own UserError, the others a quiet one of
the same kind and message (the CLI prints it once, exit 2), and no rank is left waiting in a collective.
(A refusal during the steps, through lstune's launcher and CLI: tests/distributed/test_launch.py.)"""

from __future__ import annotations


def _outcome(call) -> tuple:
    """(class name, message, quiet) of the UserError `call()` raised; ("ok", result, None) when it returned."""
    from lstune.errors import UserError

    try:
        return ("ok", call(), None)
    except UserError as exc:
        return (type(exc).__name__, str(exc), exc.quiet)


def _still_in_step() -> float:
    """An all-reduce after the refusal: every rank reaches it (none is stuck in an earlier collective)."""
    import torch
    import torch.distributed as dist

    total = torch.ones(1)
    dist.all_reduce(total)
    return total.item()


def _agreement_worker(rank: int, world: int) -> list:
    from lstune.errors import DataError
    from lstune.parallel.comm import Communicator

    comm = Communicator.of()

    def refuse_on(refusing: set):
        def check():
            if rank in refusing:
                raise DataError(f"rank {rank}'s shard is refused: fix the data.")
            return rank

        return lambda: comm.agreed(check)

    return [_outcome(refuse_on(set())), _outcome(refuse_on({0})), _outcome(refuse_on({1})),
            _outcome(refuse_on({0, 1})), _still_in_step()]


def test_one_ranks_refusal_is_every_ranks_with_its_message_printed_by_it_alone(pools):
    ranks = pools[2].run(_agreement_worker)
    assert [r[0] for r in ranks] == [("ok", 0, None), ("ok", 1, None)]  # all passed: each its own result
    message = "rank {}'s shard is refused: fix the data."
    assert [r[1] for r in ranks] == [("DataError", message.format(0), False), ("DataError", message.format(0), True)]
    assert [r[2] for r in ranks] == [("DataError", message.format(1), True), ("DataError", message.format(1), False)]
    # Both refuse: the lowest rank's message is reported (once), the other stops quietly.
    assert [r[3] for r in ranks] == [("DataError", message.format(0), False), ("DataError", message.format(0), True)]
    assert [r[4] for r in ranks] == [2.0, 2.0]


def _mask_check_worker(rank: int, world: int) -> list:
    """Ulysses attention whose model mask is causal on rank 1's shard and bidirectional on rank 0's: rank 0's check
    refuses, rank 1's passes (it would go on into the all-to-all alone)."""
    import types

    import torch

    from lstune.models.attention import ModelMask, lstune_attention_forward
    from lstune.parallel.dims import ParallelDims
    from lstune.parallel.ulysses import UlyssesAttention

    dims = ParallelDims(world, sp=world).build_groups()
    attention = UlyssesAttention(lstune_attention_forward, "lstune", dims)
    q = k = v = torch.zeros(1, 2, 4, 8)
    module = types.SimpleNamespace(is_causal=True, num_key_value_groups=1)
    positions = torch.arange(4 * rank, 4 * rank + 4)[None]
    mask = ModelMask((lambda b, h, qi, kv: kv >= 0) if rank == 0 else (lambda b, h, qi, kv: kv <= qi), None)
    outcome = _outcome(lambda: attention(module, q, k, v, mask, position_ids=positions)[0].shape)
    return [outcome, _still_in_step()]


def test_a_mask_check_one_sp_rank_refuses_stops_both_ranks_with_its_message(pools):
    ranks = pools[2].run(_mask_check_worker, timeout=120)
    (rank0, rank1), reached = zip(*ranks)
    assert rank0[0] == "ModelError" and not rank0[2] and "not causal per document" in rank0[1], rank0
    assert rank1 == ("ModelError", rank0[1], True)
    assert reached == (2.0, 2.0)


def _sp_batch_worker(rank: int, world: int) -> list:
    """The SP data adapter where rank 1's loader yields a batch without labels: its check refuses; rank 0's passes."""
    import torch

    from lstune.parallel.dims import ParallelDims
    from lstune.parallel.sp_data import SPDataAdapter

    dims = ParallelDims(world, sp=world).build_groups()
    batch = {"input_ids": torch.ones(1, 8, dtype=torch.long), "position_ids": torch.arange(8)[None],
             "shift_labels": torch.ones(1, 8, dtype=torch.long)}
    if rank == 1:
        batch.pop("shift_labels")
    outcome = _outcome(lambda: len(list(SPDataAdapter([batch], dims))))
    return [outcome, _still_in_step()]


def test_a_batch_one_sp_rank_refuses_stops_both_ranks_with_its_message(pools):
    ranks = pools[2].run(_sp_batch_worker, timeout=120)
    (rank0, rank1), reached = zip(*ranks)
    assert rank1[0] == "DataError" and "missing shift_labels" in rank1[1] and not rank1[2], rank1
    assert rank0 == ("DataError", rank1[1], True)
    assert reached == (2.0, 2.0)
