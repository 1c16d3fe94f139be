"""Per-rank memory, communication and step time of each ZeRO stage, against the formulas.

    python benchmarks/zero_stages.py [--nproc 2] [--preset demo] [--steps 8] [--out FILE]

Runs the ordinary trainer for ZeRO 0/1/2/3 on one pool of gloo processes (one CPU thread
each) and reads rank 0's metrics.jsonl: parameter/gradient/optimizer bytes after the first
step, collective bytes per step, and the median step time (first step excluded), relative
to ZeRO-0. Prints one JSON object; docs/benchmarks.md records the figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from shardwise.config.loader import load_config
from shardwise.runtime.worker_pool import WorkerPool
from shardwise.models.families import counts_of
from shardwise.observe.memory import zero_formula_bytes
from shardwise.train.trainer import train


def run(overrides: dict) -> None:
    train(load_config(overrides=overrides))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--preset", default="demo")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--out", help="also write the JSON here (rank 0's training log shares stdout)")
    args = parser.parse_args()

    out = Path(tempfile.mkdtemp(prefix="zero-stages-"))
    results = {}
    with WorkerPool(args.nproc) as pool:
        for zero in (0, 1, 2, 3):
            run_dir = out / f"zero{zero}"
            overrides = {
                "model.preset": args.preset, "parallel.zero": zero, "train.steps": args.steps,
                "train.micro_batch_size": args.micro_batch, "train.global_batch_size": args.micro_batch * args.nproc,
                "train.seq_len": args.seq_len, "train.sample_tokens": 0, "checkpoint.at_end": False,
                "run.dir": str(run_dir), "run.progress": False, "train.log_every": 10_000,
            }
            pool.run(run, overrides)
            records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
            cfg = load_config(overrides=overrides)
            results[zero] = {
                "step_time_s": statistics.median(r["step_time_s"] for r in records[1:]),
                "measured_bytes": {k: records[0][f"{k}_bytes"] for k in ("params", "grads", "optimizer")},
                "formula_bytes": zero_formula_bytes(counts_of(cfg.model).num_params(), zero, args.nproc),
                "comm_per_step": records[-1]["comm"],
                "bus_bytes_per_step": sum(v["bus_bytes"] for v in records[-1]["comm"].values()),
            }
    base = results[0]
    for r in results.values():
        r["step_time_vs_zero0"] = r["step_time_s"] / base["step_time_s"]
        r["bus_bytes_vs_zero0"] = r["bus_bytes_per_step"] / base["bus_bytes_per_step"]
    report = json.dumps({"nproc": args.nproc, "preset": args.preset, "num_params": counts_of(cfg.model).num_params(),
                         "tokens_per_step": args.micro_batch * args.nproc * args.seq_len, "stages": results}, indent=2)
    print(report)
    if args.out:
        Path(args.out).write_text(report)


if __name__ == "__main__":
    main()
