"""Pools of 2 and 4 gloo processes shared by the distributed tests (see tests/support/distributed.py), closed when
this package's tests end: idle, each worker's gloo threads still took ~13 % of a core (6 workers: ~0.8 of CI's 2
cores, measured 2026-11-28 with the suite's integration and unit trees running after them)."""

from __future__ import annotations

import pytest

from tests.support.distributed import DistributedPool


@pytest.fixture(scope="package")
def pools():
    """`pools[n]`: a lazily started pool of n gloo processes."""
    started = {n: DistributedPool(n) for n in (2, 4)}
    yield started
    for pool in started.values():
        pool.close()
