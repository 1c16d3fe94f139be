"""How far apart the two tensor-parallel ranks of a pipeline stage reach each collective, under shardwise's
own 1F1B schedule with the pipeline across two nodes on one host, against the same layout on one node.

    python benchmarks/tp_skew.py [--steps 8] [--warmup 2] [--workdir DIR]

The planner charges (tp - 1) x PIPELINE_SKEW_S (0.15 ms) per tensor-parallel collective when a layout's
pipeline spans nodes (planner/step_time.py): the stage transfers block each rank's host at its own moment,
so the tp ranks reach every collective out of step. This measures that skew here. Each run is the debug
model, tp 2 x pp 2, 8 micro-batches of 1 x 64 tokens a step, gloo on CPU: "nodes" is two `shardwise train
--nnodes 2 --nproc 2` agents (each node one tp pair, the pipeline across them), "one node" `--nproc 4`, and
"no pipeline" tp 2 x dp 2 on one node (the tp ranks with no stage transfer between collectives).

How the times come out, touching nothing of the step: every rank's flight recorder (observe/flight_recorder.py)
already stamps each collective's issue with time.time() (one host, one clock); SHARDWISE_FR_BUFFER_SIZE
makes its ring hold all the steps, and a stall injected as step `--steps` starts (SHARDWISE_FAULT=stop@N,
train.stall_timeout_s 3) has the launcher copy every rank's records into RUN/collectives/. A collective is
one (group, sequence number) of a two-rank group that is not a pipeline's point-to-point; its skew is
|start on one rank - start on the other|, over the steps after `--warmup`, up to the one before the stall.

Prints one JSON object: per run and per tp group (stage), the collectives per step, the skew's median, p90,
max and mean in microseconds, its sum per step (what the earlier rank waits), the median step time, and what
the planner would charge for them (collectives x (tp - 1) x PIPELINE_SKEW_S). Takes ~2 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from shardwise.planner.step_time import PIPELINE_SKEW_S

TINY = ["--model.preset", "debug", "--data.source", "stdlib", "--data.vocab_size", "512",
        "--data.max_corpus_bytes", "200000", "--train.global_batch_size", "8", "--train.micro_batch_size", "1",
        "--train.seq_len", "64", "--train.sample_tokens", "0", "--run.progress", "false",
        "--train.stall_timeout_s", "3", "--train.max_restarts", "0"]
PIPELINE = ["--parallel.tp", "2", "--parallel.pp", "2"]
RUNS = {"nodes": (2, PIPELINE), "one node": (1, PIPELINE), "no pipeline": (1, ["--parallel.tp", "2"])}
RING = "8192"  # records a rank keeps: ~200 collectives a step on the busiest rank


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def train(run_dir: Path, nnodes: int, layout: list[str], steps: int) -> None:
    """The run until the stall injected as step `steps` starts stops it (its exit status is not success)."""
    argv = [sys.executable, "-m", "shardwise.cli.main", "train", *TINY, *layout, "--train.steps", str(steps + 2),
            "--run.dir", str(run_dir)]
    env = {key: value for key, value in os.environ.items() if key not in ("RANK", "WORLD_SIZE")}
    env["SHARDWISE_FR_BUFFER_SIZE"] = RING
    if nnodes == 1:
        procs = [subprocess.Popen([*argv, "--nproc", "4"], env={**env, "SHARDWISE_FAULT": f"stop@{steps}:0"},
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
    else:
        nodes = ["--nnodes", str(nnodes), "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--nproc", "2"]
        procs = [subprocess.Popen([*argv, *nodes, "--node-rank", str(rank)],
                                  env={**env, "SHARDWISE_FAULT": f"stop@{steps}:n0.0"},
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for rank in range(nnodes)]
    for proc in procs:
        proc.wait(timeout=600)


def tp_starts(run_dir: Path, first: int, last: int) -> dict[tuple, dict[int, tuple[float, bool]]]:
    """(tp group ranks, seq) -> {rank: (start time, whether a stage transfer came just before on that rank)}
    for the tensor-parallel collectives of steps first..last."""
    found: dict[tuple, dict[int, tuple[float, bool]]] = {}
    for path in sorted((run_dir / "collectives").rglob("rank*.json")):
        body = json.loads(path.read_text())
        previous = None
        for record in sorted(body["records"], key=lambda record: record["global_seq"]):
            if record["group_desc"] == "mesh_tp" and first <= (record["step"] or 0) <= last:
                key = (tuple(record["group_ranks"]), record["seq"])
                found.setdefault(key, {})[body["rank"]] = (record["start_time"], previous in ("send", "recv"))
            previous = record["kind"]
    return found


def skew_stats(skews: list[float]) -> dict:
    skews = sorted(skews)
    return {"count": len(skews), "median_us": round(statistics.median(skews), 1),
            "p90_us": round(skews[int(0.9 * (len(skews) - 1))], 1), "max_us": round(skews[-1], 1),
            "mean_us": round(statistics.fmean(skews), 1)}


def summary(run_dir: Path, first: int, last: int) -> dict:
    """Each tp group's skew (all its collectives, and apart those just after a stage transfer), per step."""
    by_group: dict[tuple, dict[bool, list[float]]] = {}
    for (ranks, _), times in tp_starts(run_dir, first, last).items():
        if len(times) == 2:
            (start_a, after), (start_b, _) = times[ranks[0]], times[ranks[1]]
            by_group.setdefault(ranks, {True: [], False: []})[after].append(abs(start_a - start_b) * 1e6)
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = last - first + 1
    groups = {}
    for ranks, split in sorted(by_group.items()):
        skews = split[True] + split[False]
        groups[f"tp ranks {ranks[0]},{ranks[1]}"] = {
            **skew_stats(skews), "per_step": len(skews) / steps, "waited_per_step_ms": round(sum(skews) / steps / 1e3, 1),
            "planner_charge_per_step_ms": round(len(skews) / steps * PIPELINE_SKEW_S * 1e3, 2),
            "after_transfer": skew_stats(split[True]) if split[True] else None,
            "after_compute": skew_stats(split[False])}
    step_s = statistics.median(m["step_time_s"] for m in metrics if first <= m["step"] <= last)
    return {"steps": [first, last], "median_step_s": round(step_s, 3), "groups": groups}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--steps", type=int, default=8, help="the step the stall is injected at (not measured)")
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out")
    parser.add_argument("--workdir", help="keep the run directories here (default: a temporary folder)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(args.workdir or scratch)
        result = {"pipeline_skew_s": PIPELINE_SKEW_S}
        for name, (nnodes, layout) in RUNS.items():
            run_dir = root / name.replace(" ", "_")
            train(run_dir, nnodes, layout, args.steps)
            result[name] = summary(run_dir, args.warmup + 1, args.steps - 1)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
