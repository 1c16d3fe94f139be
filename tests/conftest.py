import pytest

from shardwise.runtime.worker_pool import WorkerPool

from shardwise.config.loader import load_config


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


# Pools live for one test module, not the session: every layout's DeviceMesh adds gloo process
# groups whose I/O threads keep polling; after a module's few dozen runs they take about a core
# (seen: the demo test ran 3.5x slower beside session-wide pools), and closing the pool ends them.
@pytest.fixture(scope="module")
def pool2():
    """Two gloo ranks, started once per test module and shared by its multi-process tests."""
    with WorkerPool(2) as pool:
        yield pool


@pytest.fixture(scope="module")
def pool4():
    """Four gloo ranks, started once per test module."""
    with WorkerPool(4) as pool:
        yield pool
