import pytest

from shardwise.distributed.worker_pool import WorkerPool


@pytest.fixture(scope="session")
def pool2():
    """Two gloo ranks, started once for every multi-process test module."""
    with WorkerPool(2) as pool:
        yield pool


@pytest.fixture(scope="session")
def pool4():
    with WorkerPool(4) as pool:
        yield pool
