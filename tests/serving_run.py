"""The tiny trained run the generation and serving tests serve: the debug model (128 positions) trained
on a 200 kB slice of the stdlib corpus long enough that its greedy answers are not one repeated token."""

from pathlib import Path

from shardwise.config.loader import load_config
from shardwise.train.trainer import train


def train_serving_run(run: Path, data_cache: str, *, steps: int = 200, **overrides) -> Path:
    """Train it into `run`; `overrides` (dotted config fields) change the model or the run's name."""
    train(load_config(overrides={
        "model.preset": "debug", "model.max_seq_len": 128, "data.source": "stdlib", "data.vocab_size": 512,
        "data.max_corpus_bytes": 200_000, "data.cache_dir": data_cache, "train.steps": steps,
        "train.global_batch_size": 8, "train.micro_batch_size": 8, "train.seq_len": 64, "train.warmup_steps": 2,
        "train.lr": 1e-2, "train.sample_tokens": 0, "run.dir": str(run), "run.progress": False, **overrides,
    }))
    return run
