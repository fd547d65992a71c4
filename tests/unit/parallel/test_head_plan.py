"""HeadPlan: which heads each SP rank holds, for the ALST cases and for head counts SP does not divide.

The attention math of every plan is checked here without processes: each rank's attention over its
heads (with the plan's kv mapping) must equal those heads' slice of full attention. The distributed
tests then check the all-to-all layout on 2 and 4 gloo processes.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lstune.errors import ModelError
from lstune.parallel.ulysses import HeadPlan


@pytest.mark.parametrize(
    ("q", "kv", "sp", "q_per_rank", "kv_per_rank"),
    [
        (32, 8, 8, 4, 1),  # ALST examples (Sec. 3.2.1)
        (32, 8, 32, 1, 1),
        (32, 4, 8, 4, 1),
        (8, 8, 4, 2, 2),  # MHA
        (8, 1, 4, 2, 1),  # MQA
    ],
)
def test_even_plans_match_alst(q, kv, sp, q_per_rank, kv_per_rank):
    plan = HeadPlan(q, kv, sp)
    assert plan.is_even
    assert set(plan.q_counts) == {q_per_rank} and set(plan.kv_counts) == {kv_per_rank}
    assert all(plan.local_kv_index(r) is None for r in range(sp))


@pytest.mark.parametrize(("q", "kv", "sp"), [(28, 4, 8), (9, 3, 4), (40, 8, 16), (40, 40, 16), (12, 3, 8)])
def test_uneven_plans_balance_heads_within_one(q, kv, sp):
    plan = HeadPlan(q, kv, sp)
    assert sum(plan.q_counts) == q and max(plan.q_counts) - min(plan.q_counts) <= 1
    assert not plan.is_even or q % sp == 0
    covered = [h for s, c in zip(plan.q_starts, plan.q_counts) for h in range(s, s + c)]
    assert covered == list(range(q))


def _attention(q, k, v):
    k = k.repeat_interleave(q.shape[1] // k.shape[1], 1)
    v = v.repeat_interleave(q.shape[1] // v.shape[1], 1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


@pytest.mark.parametrize(
    ("q", "kv", "sp"), [(28, 4, 8), (9, 3, 4), (40, 8, 16), (6, 2, 4), (32, 4, 8), (12, 3, 8), (4, 1, 4)]
)
def test_each_ranks_heads_give_the_full_attention_slice(q, kv, sp):
    torch.manual_seed(0)
    plan = HeadPlan(q, kv, sp)
    q_BHSD, k_BHSD, v_BHSD = torch.randn(1, q, 16, 8), torch.randn(1, kv, 16, 8), torch.randn(1, kv, 16, 8)
    full = _attention(q_BHSD, k_BHSD, v_BHSD)
    sent = torch.tensor(plan.kv_send_index)
    offsets = [0, *torch.tensor(plan.kv_counts).cumsum(0).tolist()]
    for r in range(sp):
        q_start, nq = plan.q_starts[r], plan.q_counts[r]
        mine = sent[offsets[r] : offsets[r + 1]]
        k_r, v_r = k_BHSD[:, mine], v_BHSD[:, mine]
        expand = plan.local_kv_index(r)
        if expand is not None:
            k_r, v_r = k_r[:, list(expand)], v_r[:, list(expand)]
        out = _attention(q_BHSD[:, q_start : q_start + nq], k_r, v_r)
        torch.testing.assert_close(out, full[:, q_start : q_start + nq], rtol=0, atol=1e-6)


def test_uneven_gqa_sends_only_needed_kv_heads():
    plan = HeadPlan(28, 4, 8)  # q groups of 7; ranks hold 4,4,4,4,3,3,3,3 q heads
    assert plan.q_counts == (4, 4, 4, 4, 3, 3, 3, 3)
    assert plan.kv_counts == (1, 2, 1, 2, 1, 2, 1, 1)
    # kv heads are sent twice only where a q group straddles two ranks: 11 sends for 4 kv heads.
    assert plan.kv_send_index == (0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3)


def test_more_ranks_than_heads_is_refused():
    with pytest.raises(ModelError, match="--sp 4"):
        HeadPlan(4, 4, 8)
