"""Tensor / sequence parallel layouts on CPU: step time, per-rank memory (parameters, gradients,
optimizer states, activations) and communication per step, against one process.

    python benchmarks/tensor_parallel.py [--preset demo] [--seq-len 512] [--steps 6] [--out FILE]

The model is the preset with an untied output head (tensor parallelism needs it). Layouts run
on one pool of 2 gloo processes (one CPU thread each); the 1-process baseline runs in this
process with one thread, so per-rank compute is comparable. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import torch

from shardwise.config.loader import load_config
from shardwise.runtime.worker_pool import WorkerPool
from shardwise.observe.activations import layout_activation_bytes
from shardwise.train.trainer import train

LAYOUTS = {"1 process": {}, "dp2": {"parallel.zero": 0}, "tp2": {"parallel.tp": 2},
           "tp2 + sp": {"parallel.tp": 2, "parallel.sp": True}}


def measure(overrides: dict) -> dict:
    cfg = load_config(overrides=overrides)
    train(cfg)
    records = [json.loads(line) for line in (Path(cfg.run.dir) / "metrics.jsonl").read_text().splitlines()]
    first = records[0]
    return {
        "step_time_s": statistics.median(r["step_time_s"] for r in records[1:]),
        "bytes": {k: first[f"{k}_bytes"] for k in ("params", "grads", "optimizer")},
        "activation_bytes": layout_activation_bytes(cfg),
        "comm_per_step": first["comm"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="demo")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--out")
    args = parser.parse_args()
    out = Path(tempfile.mkdtemp(prefix="tp-bench-"))
    base = {"model.preset": args.preset, "model.tie_embeddings": False, "train.steps": args.steps,
            "train.seq_len": args.seq_len, "train.micro_batch_size": args.micro_batch,
            "train.sample_tokens": 0, "checkpoint.at_end": False, "run.progress": False, "train.log_every": 10_000}
    results = {}
    torch.set_num_threads(1)
    with WorkerPool(2) as pool:
        for name, layout in LAYOUTS.items():
            dp = 2 if name == "dp2" else 1
            overrides = {**base, **layout, "train.global_batch_size": args.micro_batch * dp,
                         "run.dir": str(out / name.replace(" ", ""))}
            results[name] = measure(overrides) if name == "1 process" else pool.run(measure, overrides)[0]
    base_time = results["1 process"]["step_time_s"]
    for r in results.values():
        r["step_time_vs_1_process"] = r["step_time_s"] / base_time
    report = json.dumps({"preset": args.preset, "seq_len": args.seq_len, "micro_batch": args.micro_batch,
                         "layouts": results}, indent=2)
    print(report)
    if args.out:
        Path(args.out).write_text(report)


if __name__ == "__main__":
    main()
