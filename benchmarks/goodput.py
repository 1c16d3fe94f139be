"""Goodput of a job on several nodes under injected node losses (issue 39, item 4): JSON on stdout.

Three nodes on this host (`shardwise train --nnodes 2:3 --node-rank R`, --nproc each, gloo), the same tiny
Llama-shaped model as the tests. A node's launcher is killed (SIGKILL: its ranks die with it) every
`--every` steps, nodes 1 and 2 in turn, and started again at once, as a cluster scheduler replaces a node:
the job shrinks to the nodes left, then grows back at its next checkpoint. The same job without faults runs
first, as the baseline.

    goodput = (time of the steps that count: each step of the final metrics.jsonl once, its step_time_s)
              / (the job's wall time, from the first launcher's start to the last one's end)

It counts everything a failure costs: detecting the lost node, the head's decision, torch's rendezvous
(and train.rejoin_timeout_s waiting for the lost node), starting the ranks again, loading the checkpoint,
the steps redone since it, and the grow back (a save, every rank restarted). On this 2-core machine the
ranks of three nodes share two cores and a step takes a fraction of a second, so the fixed cost of a
restart weighs far more than on a cluster; `cost_per_loss_s` (the wall time a loss adds to the baseline)
is the figure that carries over: goodput with a loss every H hours is about 1 - cost / H.

    python benchmarks/goodput.py [--steps 90] [--every 30] [--nproc 1] [--replace-after 0]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODEL = ["--model.preset=debug", "--data.source=stdlib", "--data.vocab_size=512", "--data.max_corpus_bytes=200000",
         "--train.global_batch_size=12", "--train.micro_batch_size=2", "--train.seq_len=128", "--train.lr=1e-2",
         "--train.warmup_steps=2", "--train.sample_tokens=0", "--run.progress=false", "--checkpoint.every=10",
         "--train.rejoin_timeout_s=5", "--train.max_restarts=20"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start(rank: int, port: int, run_dir: Path, args, fault: str) -> subprocess.Popen:
    command = [sys.executable, "-m", "shardwise.cli.main", "train", "--nnodes=2:3", f"--node-rank={rank}",
               f"--rdzv-endpoint=127.0.0.1:{port}", f"--nproc={args.nproc}", f"--train.steps={args.steps}",
               f"--run.dir={run_dir}", *MODEL]
    env = {key: value for key, value in os.environ.items() if key not in ("RANK", "WORLD_SIZE")}
    return subprocess.Popen(command, env={**env, "SHARDWISE_FAULT": fault}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)


def run_job(run_dir: Path, args, fault: str) -> dict:
    """Three nodes until the head ends; a node killed by the fault is started again `args.replace_after` s later."""
    port, started, losses, lines = free_port(), time.monotonic(), 0, []
    nodes = {rank: start(rank, port, run_dir, args, fault) for rank in range(3)}
    lost_at: dict[int, float] = {}
    while nodes[0].poll() is None:
        for rank in (1, 2):
            if nodes[rank].poll() == -signal.SIGKILL and rank not in lost_at:
                losses += 1
                lost_at[rank] = time.monotonic()
            if rank in lost_at and time.monotonic() - lost_at[rank] >= args.replace_after:
                del lost_at[rank]
                nodes[rank] = start(rank, port, run_dir, args, fault)
        time.sleep(0.1)
    for rank in (1, 2):
        try:
            nodes[rank].wait(timeout=60)
        except subprocess.TimeoutExpired:
            nodes[rank].kill()
    wall = time.monotonic() - started
    stderr = nodes[0].stderr.read()
    if nodes[0].returncode != 0:
        raise SystemExit(f"the head node exited with {nodes[0].returncode}:\n{stderr[-3000:]}")
    lines = [line for line in stderr.splitlines() if line.startswith("shardwise:")]
    records = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        records[record["step"]] = record
    useful = sum(record["step_time_s"] for record in records.values())
    return {"exit_status": nodes[0].returncode, "wall_s": round(wall, 1), "useful_step_time_s": round(useful, 1),
            "goodput": round(useful / wall, 3), "steps": len(records), "node_losses": losses, "head_lines": lines}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=90)
    parser.add_argument("--every", type=int, default=30, help="a node is lost every this many steps")
    parser.add_argument("--nproc", type=int, default=1, help="ranks per node")
    parser.add_argument("--replace-after", type=float, default=0.0,
                        help="seconds before a lost node is started again (past train.rejoin_timeout_s, 5 s here, the "
                             "job shrinks first and grows back when it returns)")
    args = parser.parse_args()
    kills = [f"kill_launcher@{step}:n{1 + index % 2}.0"
             for index, step in enumerate(range(args.every, args.steps, args.every))]
    with tempfile.TemporaryDirectory(prefix="shardwise-goodput-") as tmp:
        baseline = run_job(Path(tmp) / "baseline", args, "")
        faulty = run_job(Path(tmp) / "faulty", args, ",".join(kills))
    cost = (faulty["wall_s"] - baseline["wall_s"]) / max(1, faulty["node_losses"])
    print(json.dumps({"nodes": 3, "nproc_per_node": args.nproc, "steps": args.steps, "faults": kills,
                      "replace_after_s": args.replace_after,
                      "baseline": baseline, "with_node_losses": faulty, "cost_per_loss_s": round(cost, 1),
                      "goodput_with_a_loss_every_hour": round(1 - cost / 3600, 4)}, indent=1))


if __name__ == "__main__":
    main()
