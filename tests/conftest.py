import collections
import os
import shutil
import tempfile

import pytest
import torch

from shardwise.runtime.worker_pool import PRELOAD, WorkerPool

from shardwise.config.loader import load_config


def pytest_configure(config):
    use_one_thread_per_process()
    keep_one_inductor_cache_for_the_run(config)
    keep_the_order_of_the_files(config)


def pytest_xdist_auto_num_workers(config):
    """`-n auto`: two test processes per core (pyproject's --maxprocesses caps it). Many tests wait
    rather than compute: on launched jobs and servers starting, on stall timeouts, rejoin windows
    and stragglers they inject. With one test process per core the whole suite kept 2 cores busy
    about half the time (user + system 9.4 min of CPU in a 9.6 min run, 2 cores: 19.2)."""
    return 2 * len(os.sched_getaffinity(0))


def use_one_thread_per_process():
    """One intra-op thread in the test process and in every process it starts (pool workers take
    one each already), unless OMP_NUM_THREADS is set. The models here are tiny: a second thread
    barely helps them, and where the 2 cores are shared (the test process beside a pool, a launched
    job or another user) torch's threads wait on each other: a 20-step ViT run took 28 s with 2
    threads beside one busy process, 5.6 s with 1."""
    if "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)


def keep_one_inductor_cache_for_the_run(config):
    """One inductor cache for the whole run, empty at its start: compiled graphs are reused by every
    later test, pool worker and subprocess of the run (they inherit the variable), and a run never
    depends on what an earlier run left in /tmp (CI starts from a fresh clone). A developer who sets
    TORCHINDUCTOR_CACHE_DIR keeps theirs. Set here, before any test module imports inductor."""
    if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
        path = tempfile.mkdtemp(prefix="shardwise-inductor-")
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = path
        config.add_cleanup(lambda: shutil.rmtree(path, ignore_errors=True))


def keep_the_order_of_the_files(config):
    """pytest-xdist's `--dist loadfile` hands out the files in the order `pytest_collection_modifyitems`
    below leaves them, not re-sorted by how many tests each holds (its default, `--loadscope-reorder`,
    which has no idea of their seconds): re-sorted, the 4 fuzzing tests of the server (~37 s) were
    the 91st file of 108 and the block-memory tests (~24 s) the 85th."""
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(items):
    """A test that runs on a worker pool is slow (-m "not slow" leaves it out): the fast tier is the
    tests of one process. Then the files with the most slow tests run first: pytest-xdist hands each
    test process whole files in this order, and a long file handed out last would leave one core
    idle while the other finishes it (the compiled layouts alone take a quarter of the suite)."""
    for item in items:
        if {"pool2", "pool4"} & set(item.fixturenames):
            item.add_marker(pytest.mark.slow)
    slow_in_file = collections.Counter(item.path for item in items if item.get_closest_marker("slow"))
    items.sort(key=lambda item: -slow_in_file[item.path])  # stable: each file's tests stay together, in order


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory):
    """One tokenizer/token cache for the whole session: each config below reuses it."""
    return str(tmp_path_factory.mktemp("shardwise-cache"))


@pytest.fixture
def tiny_config(tmp_path, data_cache):
    """A factory of tiny, fast training configs on a small slice of the stdlib corpus."""

    def make(**overrides):
        values = {
            "model.preset": "debug",
            "data.source": "stdlib",
            "data.vocab_size": 512,
            "data.max_corpus_bytes": 200_000,
            "data.cache_dir": data_cache,
            "train.steps": 6,
            "train.global_batch_size": 4,
            "train.micro_batch_size": 2,
            "train.seq_len": 32,
            "train.warmup_steps": 2,
            "train.lr": 1e-2,
            "train.sample_tokens": 0,
            "run.dir": str(tmp_path / "run"),
            "run.progress": False,
        }
        values.update(overrides)
        return load_config(overrides=values)

    return make


# One pool per world size for the whole session. Each job's ranks are forked from one server
# process that imported torch once, build the job's process group, and exit with it
# (shardwise/runtime/worker_pool.py): a job leaves nothing behind for the next test. The server
# starts with the first pool and keeps the environment of that moment (pytest_configure's above).
POOL_PRELOAD = (*PRELOAD, "sklearn.datasets", "pool_warmup")
"""What the pools' fork server imports before forking any rank (tests/pool_warmup.py: the CPU's peak).
scikit-learn holds the ViT's digits (data/images.py): importing it took each rank of each ViT layout
3.5 s of one core, the fork server now once (an ImportError here is skipped: then a ViT rank says so)."""


@pytest.fixture(scope="session")
def pool2():
    """Two gloo ranks per job, for every multi-process test of the session."""
    with WorkerPool(2, preload=POOL_PRELOAD) as pool:
        yield pool


@pytest.fixture(scope="session")
def pool4():
    """Four gloo ranks per job."""
    with WorkerPool(4, preload=POOL_PRELOAD) as pool:
        yield pool
