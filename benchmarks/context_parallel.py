"""Context parallelism and activation recomputation: memory per rank, compute balance, time.

    python benchmarks/context_parallel.py [--seq 2048 4096 8192] [--cp 1 2 4] [--rounds 3] [--out FILE]

1. Activation memory per rank: the bytes autograd saves during one forward + loss of the
   `debug` model (dim 64, 2 blocks, 4 heads / 2 kv heads, vocabulary 512, micro-batch 1) at
   each sequence length, under ring attention with cp = 1, 2, 4 (gloo processes); the ratio
   to cp = 1 against the ideal 1/cp.
2. Compute balance at the longest sequence, for each cp > 1: the causal attention work per
   rank (query-key score elements computed, exact; and seconds spent in the attention kernels,
   measured) with zigzag chunks vs contiguous chunks.
3. Recomputation: for the `demo` model (dim 256, 4 blocks) at 2 x 1024 tokens in one process,
   the bytes a forward pass leaves alive for backward (`LiveOutputBytes`, which also sees what a
   recomputation region keeps) and the forward + backward time of none / full / selective,
   alternating between modes for `--rounds` rounds (medians).
Prints one JSON object; docs/benchmarks.md records the figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from shardwise.config.loader import load_config
from shardwise.runtime.worker_pool import WorkerPool


def cp_overrides(seq: int, cp: int, load_balance: bool = True) -> dict:
    return {
        "model.preset": "debug", "model.max_seq_len": seq, "train.seq_len": seq, "data.vocab_size": 512,
        "train.global_batch_size": 1, "train.micro_batch_size": 1, "train.device": "cpu",
        "run.dir": tempfile.mkdtemp(prefix="cp-bench-"), "run.progress": False,
        "parallel.cp": cp, "parallel.cp_load_balance": load_balance,
    }


def probe(overrides: dict) -> dict:
    """On every rank: saved activation bytes of one forward + loss, then the ring attention's
    work on this rank over one forward + backward."""
    import torch.distributed as dist

    from shardwise.distributed.dims import ParallelDims
    from shardwise.distributed.parallelize import parallelize_config
    from shardwise.models.common.loss import loss_of
    from shardwise.observe.activations import saved_activation_bytes

    cfg = load_config(overrides=overrides)
    world = dist.get_world_size() if dist.is_initialized() else 1
    dims = ParallelDims.from_config(cfg.parallel, world)
    device = torch.device("cpu")
    dp = parallelize_config(cfg, dims, device=device)
    gen = torch.Generator().manual_seed(0)
    inputs, targets = (torch.randint(0, cfg.model.vocab_size, (1, cfg.train.seq_len), generator=gen) for _ in range(2))
    if dp.context is not None:
        inputs, targets = dp.context.split(inputs), dp.context.split(targets)
    def forward_loss():
        return loss_of(dp.module, inputs, targets, autocast_dtype=cfg.train.autocast_dtype, device=device)

    loss, saved = saved_activation_bytes(forward_loss)
    attention = dp.context.attention if dp.context is not None else None
    if attention is not None:
        attention.work[:] = [0, 0.0]
    start = time.perf_counter()
    loss.backward()
    forward_loss().backward()
    elapsed = time.perf_counter() - start
    work = list(attention.work) if attention is not None else [None, None]
    return {"saved_bytes": saved, "score_elements": work[0], "kernel_s": work[1], "step_s": elapsed}


def memory_per_rank(seqs: list[int], cps: list[int]) -> list[dict]:
    rows = []
    for cp in cps:
        pool = WorkerPool(cp) if cp > 1 else None
        try:
            for seq in seqs:
                by_rank = pool.run(probe, cp_overrides(seq, cp)) if pool else [probe(cp_overrides(seq, 1))]
                rows.append({"seq": seq, "cp": cp, "saved_bytes_per_rank": [r["saved_bytes"] for r in by_rank]})
        finally:
            if pool:
                pool.close()
    base = {r["seq"]: r["saved_bytes_per_rank"][0] for r in rows if r["cp"] == 1}
    for r in rows:
        if r["seq"] in base:
            r["ratio_to_cp1"] = round(max(r["saved_bytes_per_rank"]) / base[r["seq"]], 4)
            r["ideal"] = round(1 / r["cp"], 4)
    return rows


def balance(seq: int, cp: int) -> dict:
    out = {}
    with WorkerPool(cp) as pool:
        for name, load_balance in (("zigzag", True), ("contiguous", False)):
            by_rank = pool.run(probe, cp_overrides(seq, cp, load_balance))
            elements = [r["score_elements"] for r in by_rank]
            seconds = [round(r["kernel_s"], 4) for r in by_rank]
            out[name] = {"score_elements_per_rank": elements, "kernel_s_per_rank": seconds,
                         "max_over_mean_elements": round(max(elements) / statistics.mean(elements), 4),
                         "max_over_mean_kernel_s": round(max(seconds) / statistics.mean(seconds), 4)}
    return out


def recompute_trade_off(rounds: int) -> dict:
    from shardwise.models.llama.model import build_model
    from shardwise.config.presets import model_config
    from shardwise.observe.activations import LiveOutputBytes
    from shardwise.distributed.recompute import apply_recompute
    from shardwise.models.build import plan_of

    cfg = model_config("demo")
    tokens = torch.randint(0, cfg.vocab_size, (2, 1024), generator=torch.Generator().manual_seed(0))
    models, memory, times = {}, {}, {}
    for mode in ("none", "full", "selective"):
        models[mode] = build_model(cfg)
        apply_recompute([models[mode]], plan_of(cfg), mode)

    def forward(model):
        return F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())

    for mode, model in models.items():
        with LiveOutputBytes() as live:
            loss = forward(model)
            memory[mode] = live.sample()
        loss.backward()
        times[mode] = []
    for _ in range(rounds):
        for mode, model in models.items():
            start = time.perf_counter()
            forward(model).backward()
            times[mode].append(time.perf_counter() - start)
    median = {mode: statistics.median(t) for mode, t in times.items()}
    return {mode: {"forward_leaves_bytes": memory[mode], "memory_vs_none": round(memory[mode] / memory["none"], 4),
                   "fwd_bwd_s": round(median[mode], 4), "time_vs_none": round(median[mode] / median["none"], 4)}
            for mode in models}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, nargs="+", default=[2048, 4096, 8192])
    parser.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", help="also write the JSON here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    result = {
        "activation_memory": memory_per_rank(args.seq, args.cp),
        "balance": [{"seq": max(args.seq), "cp": cp, **balance(max(args.seq), cp)} for cp in args.cp if cp > 1],
        "recompute": recompute_trade_off(args.rounds),
    }
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
