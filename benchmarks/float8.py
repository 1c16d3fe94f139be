"""FP8 against bf16 training on a GPU, side by side (issue 40, item 5): for a lent GPU machine.

    python benchmarks/float8.py [--preset llama3-1b] [--steps 200] [--recipes tensorwise,rowwise]
                                [--batch 8] [--seq-len 2048] [--out /tmp/float8]

Trains the same run (the demo's data, seed, batch and schedule) with `train.compile` and bf16 autocast,
once per recipe ("none" first: the bf16 baseline), each through the `shardwise train` command, and
prints one JSON object: per recipe the median tokens/s and MFU over the steps after the first 10
(compilation), the peak memory, and the loss at the end (mean of the last 10 steps), with each
recipe's ratio to bf16 and the relative gap of its final loss (the issue's goal: within 1%). Each
run's metrics.jsonl is kept under --out for the loss curves. On a CPU every float8 run is refused
with one line (train.float8 needs FP8 tensor cores), which the JSON reports.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path


def train(recipe: str, args) -> dict:
    run_dir = Path(args.out) / recipe
    argv = [sys.executable, "-m", "shardwise.cli.main", "train", "--nproc", "1", "--model.preset", args.preset,
            "--data.vocab_size", str(args.data_vocab), "--train.steps", str(args.steps), "--train.global_batch_size", str(args.batch),
            "--train.micro_batch_size", str(args.batch), "--train.seq_len", str(args.seq_len),
            "--model.max_seq_len", str(args.seq_len), "--train.compile", "true",
            "--train.autocast_dtype", "bfloat16", "--train.float8", recipe, "--train.sample_tokens", "0",
            "--checkpoint.at_end", "false", "--run.progress", "false", "--run.dir", str(run_dir),
            "--checkpoint.overwrite", "true", "--checkpoint.resume", "false"]
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        return {"refused" if done.returncode == 2 else "failed": (done.stderr.strip().splitlines() or ["?"])[-1]}
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [row for row in rows if "loss" in row and "tokens_per_s" in row]
    timed = steps[10:] or steps
    return {"tokens_per_s": statistics.median(row["tokens_per_s"] for row in timed),
            "mfu": statistics.median(row["mfu"] for row in timed),
            "peak_memory_gib": max(row.get("peak_memory_gib", 0.0) for row in steps),
            "final_loss": statistics.fmean(row["loss"] for row in steps[-10:]),
            "losses": [row["loss"] for row in steps], "metrics": str(run_dir / "metrics.jsonl")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="llama3-1b")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--recipes", default="tensorwise,rowwise")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--data-vocab", type=int, default=4096, help="the demo tokenizer's size (512 for debug)")
    parser.add_argument("--out", default="/tmp/float8")
    args = parser.parse_args()
    results = {recipe: train(recipe, args) for recipe in ["none", *args.recipes.split(",")]}
    base = results["none"]
    for recipe, result in results.items():
        if recipe != "none" and "tokens_per_s" in result and "tokens_per_s" in base:
            result["speedup"] = result["tokens_per_s"] / base["tokens_per_s"]
            result["memory_ratio"] = result["peak_memory_gib"] / base["peak_memory_gib"]
            result["final_loss_gap"] = result["final_loss"] / base["final_loss"] - 1
    for result in results.values():
        result.pop("losses", None)
    print(json.dumps({"preset": args.preset, "steps": args.steps, "batch": args.batch, "seq_len": args.seq_len,
                      "runs": results}, indent=1))


if __name__ == "__main__":
    main()
