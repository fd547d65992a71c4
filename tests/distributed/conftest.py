"""Session-wide pools of 2 and 4 gloo processes shared by the distributed tests (see tests/support/distributed.py)."""

from __future__ import annotations

import pytest

from tests.support.distributed import DistributedPool


@pytest.fixture(scope="session")
def pools():
    """`pools[n]`: a lazily started pool of n gloo processes."""
    started = {n: DistributedPool(n) for n in (2, 4)}
    yield started
    for pool in started.values():
        pool.close()
