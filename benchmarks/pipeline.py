"""The pipeline bubble, measured against theory, and the activation peak of GPipe vs 1F1B.

    python benchmarks/pipeline.py [--pp 2 4] [--m 2 4 8] [--steps 5] [--out FILE] [--pictures DIR]

For each pipeline degree p (one pool of p gloo processes, one CPU thread each; give the
machine at least p cores or the ranks time-share), each schedule and each micro-batch count
m, trains the ordinary trainer for a few steps on a model with 4p blocks (untied, dim 256,
seq 128, micro-batch 2) and reads the per-rank timelines: the measured bubble ratio
(idle / busy, median of steps after the first) next to (p-1)/(v*m). Then, at m = 8, the peak
of saved activations per rank under GPipe and 1F1B. Prints one JSON object; with --pictures,
also writes each run's timeline PNG there. docs/benchmarks.md records the figures.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

from shardwise.config.loader import load_config
from shardwise.distributed.pipeline_parallel import schedule_available
from shardwise.runtime.worker_pool import WorkerPool
from shardwise.observe.activations import pipeline_peak_activation_bytes
from shardwise.observe.pipeline_timeline import load_timelines, measured_bubble, pipeline_report, theoretical_bubble
from shardwise.train.trainer import train

SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("zero-bubble", 2), ("zbv", 2)]


def run(overrides: dict) -> None:
    train(load_config(overrides=overrides))


def overrides_for(out: Path, name: str, *, pp: int, schedule: str, virtual: int, m: int, steps: int) -> dict:
    micro = 2
    return {
        "model.preset": "demo", "model.tie_embeddings": False, "model.n_layers": 4 * pp,
        "data.source": "stdlib", "data.max_corpus_bytes": 400_000, "data.cache_dir": str(out / "cache"),
        "train.steps": steps, "train.global_batch_size": micro * m, "train.micro_batch_size": micro,
        "train.seq_len": 128, "train.warmup_steps": 1, "train.sample_tokens": 0,
        "run.dir": str(out / name), "run.progress": False, "checkpoint.at_end": False, "train.device": "cpu",
        "parallel.pp": pp, "parallel.pp_schedule": schedule, "parallel.pp_virtual_stages": virtual,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, nargs="+", default=[2])
    parser.add_argument("--m", type=int, nargs="+", default=[2, 4, 8], help="micro-batch counts (each >= p is run)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", help="also write the JSON here")
    parser.add_argument("--pictures", help="copy each run's timeline PNG into this folder")
    args = parser.parse_args()

    out = Path(tempfile.mkdtemp(prefix="pipeline-bench-"))
    bubble, memory = [], []
    for pp in args.pp:
        with WorkerPool(pp) as pool:
            for schedule, virtual in SCHEDULES:
                if not schedule_available(schedule):
                    continue
                for m in args.m:
                    if m < pp:
                        continue
                    name = f"{schedule}-p{pp}-m{m}"
                    overrides = overrides_for(out, name, pp=pp, schedule=schedule, virtual=virtual, m=m,
                                              steps=args.steps)
                    pool.run(run, overrides)
                    measured = measured_bubble(load_timelines(out / name)[1])
                    theory = theoretical_bubble(pp, virtual, m) if schedule in ("gpipe", "1f1b", "interleaved-1f1b") else None
                    bubble.append({"schedule": schedule, "p": pp, "v": virtual, "m": m,
                                   "theory": theory, "measured": round(measured["bubble_ratio"], 3),
                                   "busiest_rank": round(measured["busiest_rank_bubble"], 3),
                                   "idle_fraction_by_rank": [round(f, 3) for f in measured["idle_fraction"].values()],
                                   "step_window_s": round(measured["window_s"], 4)})
                    print(json.dumps(bubble[-1]), flush=True)
                    if args.out:
                        Path(args.out).write_text(json.dumps({"bubble": bubble}, indent=1) + "\n")
                    if args.pictures:
                        _, picture = pipeline_report(out / name)
                        Path(args.pictures).mkdir(parents=True, exist_ok=True)
                        shutil.copy(picture, Path(args.pictures) / f"{name}.png")
            for schedule in ("gpipe", "1f1b"):
                overrides = overrides_for(out, f"memory-{schedule}-p{pp}", pp=pp, schedule=schedule, virtual=1, m=8,
                                          steps=1)
                peaks = pool.run(pipeline_peak_activation_bytes, load_config(overrides=overrides))
                memory.append({"schedule": schedule, "p": pp, "m": 8,
                               "peak_activation_MiB_by_rank": [round(r["peak_bytes"] / 2**20, 2) for r in peaks]})
                print(json.dumps(memory[-1]), flush=True)
    result = {"bubble": bubble, "activation_peak": memory}
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
