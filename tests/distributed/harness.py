"""The parity harness: run a layout on N gloo processes and compare it with one process.

`WorkerPool(n)` (shardwise.runtime.worker_pool; the session's `pool2` and `pool4` fixtures in
tests/conftest.py) runs each job on n ranks forked from one process that imported torch once,
on a gloo process group built for the job and destroyed after it, so each layout costs a
training run, not a process launch, and leaves nothing behind for the next test.
`check_parity` trains the reference (this process, no process group) and the layout (the
pool) from the same seed and global batch, and compares loss per step and final parameters.

Tolerance: fp32 on CPU, rtol = atol = 1e-5. The layouts compute the same sums in a
different order (a gradient is a sum over ranks of sums over micro-batches instead of one
sum), which moves the last bits (~1e-7 relative per step). AdamW divides by sqrt(v): for a
gradient element near zero, a last-bit difference changes its normalised update by up to ~lr,
so parameter differences scale with the learning rate. Parity runs use lr = 1e-3 (with lr =
1e-2, 1 element in 10^4 drifted to 1.03e-5 after 4 steps) and AdamW eps = 1e-6: the update's
sensitivity to its gradient is bounded by lr / eps, and with torch's default eps = 1e-8 one
element in 10^4 of tp2 (a gate_proj weight) drifted to 1.05e-5 on an AVX-512 CPU while
passing on others. The layouts run the same optimizer as the reference, so eps conditions the
comparison without hiding a layout's error; losses and parameters then agree well inside 1e-5
without being bitwise equal.
"""

from __future__ import annotations

import torch

from shardwise.config.loader import load_config
from shardwise.distributed.dims import ParallelDims
from shardwise.runtime.worker_pool import WorkerPool
from shardwise.infer.load import load_run
from shardwise.train.trainer import train

RTOL = ATOL = 1e-5


def layout(tmp_path, data_cache, name, **parallel):
    """A tiny parity run: the debug model, 4 steps, 8 sequences of 32 tokens, lr 1e-3, AdamW eps 1e-6."""
    return {
        "model.preset": "debug", "data.source": "stdlib", "data.vocab_size": 512,
        "data.max_corpus_bytes": 200_000, "data.cache_dir": data_cache,
        "train.steps": 4, "train.global_batch_size": 8, "train.micro_batch_size": 2, "train.seq_len": 32,
        "train.warmup_steps": 1, "train.lr": 1e-3, "train.eps": 1e-6, "train.sample_tokens": 0,
        "run.dir": str(tmp_path / name), "run.progress": False,
        "train.device": "cpu",  # the pools are gloo processes, also on a machine with an accelerator
        **{f"parallel.{k}": v for k, v in parallel.items()},
    }


def train_job(overrides: dict) -> dict:
    """What each rank runs: the ordinary trainer on the pool's process group."""
    result = train(load_config(overrides=overrides))
    return {"losses": result.losses, "micro_batches": result.micro_batches_per_step, "val_losses": result.val_losses}


def final_params(run_dir) -> dict[str, torch.Tensor]:
    """The newest checkpoint's weights, loaded into one process (this also reshards it)."""
    _, model, _ = load_run(run_dir)
    return {name: p.detach().clone() for name, p in model.named_parameters()}


_references: dict[tuple, tuple[list[float], dict[str, torch.Tensor]]] = {}


def run_reference(overrides: dict) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process's losses and final parameters for `overrides` without its parallel degrees.

    Kept for the test session: one process from one seed trains the same way each time, so the
    layouts of one configuration (e.g. every compiled layout of the debug model) share one
    reference run instead of each compiling and training it again. Callers only read it."""
    single = {k: v for k, v in overrides.items() if not k.startswith("parallel.")}
    single["run.dir"] = overrides["run.dir"] + "-reference"
    key = tuple(sorted((k, repr(v)) for k, v in single.items() if k != "run.dir"))
    if key not in _references:
        losses = train(load_config(overrides=single)).losses
        _references[key] = (losses, final_params(single["run.dir"]))
    return _references[key]


def check_parity(pool: WorkerPool, overrides: dict, reference=None) -> dict:
    """Train `overrides` on the pool and on one process; assert equal losses and parameters."""
    ref_losses, ref_params = reference or run_reference(overrides)
    by_rank = pool.run(train_job, overrides)
    cfg = load_config(overrides=overrides)
    # Each data-parallel rank must run its share of the global batch, not all of it (which would
    # also match the losses); tensor-parallel ranks share a data-parallel rank's batch.
    dp = ParallelDims.from_config(cfg.parallel, pool.world_size).dp
    share = cfg.train.global_batch_size // (cfg.train.micro_batch_size * dp)
    assert [r["micro_batches"] for r in by_rank] == [share] * pool.world_size
    losses_by_rank = [r["losses"] for r in by_rank]
    for rank, losses in enumerate(losses_by_rank):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=RTOL, atol=ATOL,
                                   msg=lambda m: f"rank {rank} losses differ from one process: {m}")
    params = final_params(overrides["run.dir"])
    assert params.keys() == ref_params.keys()
    for name, value in params.items():
        torch.testing.assert_close(value, ref_params[name], rtol=RTOL, atol=ATOL,
                                   msg=lambda m: f"parameter {name} differs from one process: {m}")
    return {"losses": losses_by_rank[0], "reference_losses": ref_losses}


def assert_resumed_run_equals(losses: list[float], run_dir, reference) -> None:
    """A run resumed across layouts (its losses, step by step, and final parameters in run_dir)
    equals the uninterrupted `reference` (a TrainResult)."""
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference.losses), rtol=RTOL, atol=ATOL)
    resumed, uninterrupted = final_params(run_dir), final_params(reference.run_dir)
    for name, value in resumed.items():
        torch.testing.assert_close(value, uninterrupted[name], rtol=RTOL, atol=ATOL)


def activation_job(overrides: dict, seed: int = 0) -> int:
    """Bytes autograd saves for backward during one forward + loss of the layout, on this rank."""
    from shardwise.observe.activations import layout_activation_bytes

    return layout_activation_bytes(load_config(overrides=overrides), seed=seed)


def generate_argv(run_dir: str, *extra: str) -> list[str]:
    return ["generate", "--run", run_dir, "--prompt", "def ", "--max-new-tokens", "24", "--temperature", "0", *extra]


def generate_job(run_dir: str) -> str:
    """`shardwise generate --nproc 2 --parallel.tp 2` on each rank, as the launched workers run it."""
    from shardwise.cli.main import build_parser
    from shardwise.infer.commands import generate_text

    return generate_text(build_parser().parse_args(generate_argv(run_dir, "--nproc", "2", "--parallel.tp", "2")))


def check_tp_generation(pool, overrides: dict) -> None:
    """Train `overrides` in this process, then greedy generation under tp2 on the pool equals one process's."""
    from shardwise.cli.main import build_parser
    from shardwise.infer.commands import generate_text

    train(load_config(overrides=overrides))
    single = generate_text(build_parser().parse_args(generate_argv(overrides["run.dir"])))
    assert pool.run(generate_job, overrides["run.dir"]) == [single, single]
    assert len(single) > len("def ")
