import pytest

from shardwise.distributed.worker_pool import WorkerPool

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


@pytest.fixture(scope="session")
def pool2():
    """Two gloo ranks, started once for the whole session and shared by every multi-process test."""
    with WorkerPool(2) as pool:
        yield pool


@pytest.fixture(scope="session")
def pool4():
    """Four gloo ranks, started once for the whole session."""
    with WorkerPool(4) as pool:
        yield pool
