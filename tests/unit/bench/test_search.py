"""The longest-sequence search against a grid of limits: exact to the step, in few trials, every trial kept."""

from __future__ import annotations

import math

import pytest

from lstune.bench.search import find_max_len

STEP = 1024


def _probe(limit: int, calls: list[int], outcome: str = "oom"):
    def probe(n: int) -> dict:
        calls.append(n)
        return {"id": len(calls), "seq_len": n, "outcome": "ok" if n <= limit else outcome}

    return probe


@pytest.mark.parametrize("limit", [0, 500, 1024, 1500, 3 * 1024, 7 * 1024 + 5, 8 * 1024, 13 * 1024, 64 * 1024,
                                   100 * 1024 + 1, 255 * 1024])
@pytest.mark.parametrize("start", [1024, 8 * 1024, 48 * 1024])
def test_the_search_finds_the_longest_multiple_of_the_step_under_the_limit(limit, start):
    calls: list[int] = []
    found = find_max_len(_probe(limit, calls), start=start, step=STEP)
    expected = limit // STEP * STEP
    assert found.longest_ok == expected
    assert found.shortest_failed == (expected + STEP if expected else STEP)
    assert all(n % STEP == 0 for n in calls) and len(set(calls)) == len(calls)  # no length tried twice
    assert len(found.trials) == len(calls)  # every trial recorded
    bound = 2 * math.log2(max(limit, start, STEP) / STEP + 1) + 3
    assert len(calls) <= bound, (calls, bound)


@pytest.mark.parametrize("outcome", ["host-oom", "timeout", "crash"])
def test_running_out_of_host_memory_or_time_or_crashing_counts_as_not_fitting(outcome):
    found = find_max_len(_probe(5 * 1024, [], outcome), start=1024, step=STEP)
    assert found.longest_ok == 5 * 1024 and found.stopped is None


def test_max_len_bounds_the_search_and_says_nothing_failed():
    calls: list[int] = []
    found = find_max_len(_probe(10**9, calls), start=1024, step=STEP, max_len=20 * 1024)
    assert found.longest_ok == 20 * 1024 and found.shortest_failed is None
    assert max(calls) == 20 * 1024


def test_a_trial_that_errors_for_another_reason_ends_the_search():
    def probe(n):
        return {"seq_len": n, "outcome": "error", "error": "ValueError: a bug"}

    found = find_max_len(probe, start=4096, step=STEP)
    assert found.longest_ok == 0 and len(found.trials) == 1 and "a bug" in found.stopped
