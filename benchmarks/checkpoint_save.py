"""What a checkpoint save costs the training loop, synchronous vs checkpoint.async_save (issue 17 item 7).

    python benchmarks/checkpoint_save.py [--preset demo] [--saves 5] [--steps-between 4]

One process, the demo model (the default of `shardwise train`) with AdamW state, training steps
timed alone and around saves. Synchronous: the loop waits for the whole save (write, state.json,
manifest hashes, rename). Asynchronous: the loop waits for the copy to host memory, then the
next steps run while a thread writes (on a 2-core machine the two compete for the cores), and
the next save waits for the previous to be completed (`PendingSave.finish`). Reported per save,
as medians: the time the loop was blocked, and the extra time of the steps that ran beside the
background write over the median plain step. Prints one JSON object; docs/benchmarks.md
records the figures.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import tempfile
import time

from shardwise.config.loader import load_config
from shardwise.checkpoint.store import checkpoint_tensors, save_checkpoint, save_checkpoint_async
from shardwise.train.context import open_run_context
from shardwise.train.setup import build, set_up
from shardwise.train.trainer import run_step
from shardwise.observe.comm_log import CommLog


def measure(preset: str, saves: int, steps_between: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="shardwise-ckpt-bench-") as tmp, contextlib.ExitStack() as stack:
        cfg = load_config(overrides={"model.preset": preset, "run.dir": f"{tmp}/run", "run.progress": False,
                                     "train.sample_tokens": 0, "train.steps": 10_000})
        run = set_up(cfg, stack.enter_context(open_run_context(cfg)))
        pm, optimizer = build(run)
        comm_log = CommLog()
        step = 0

        def one_step() -> float:
            nonlocal step
            step += 1
            started = time.perf_counter()
            run_step(run, pm, optimizer, comm_log, step)
            return time.perf_counter() - started

        for _ in range(3):  # warm-up: allocator, AdamW state
            one_step()
        plain = statistics.median(one_step() for _ in range(2 * steps_between))

        def state() -> dict:
            return {"loader": run.loader.state_dict(), "layout": run.dims.describe()}

        sync_blocked, async_blocked, async_extra = [], [], []
        for _ in range(saves):
            for _ in range(steps_between):
                one_step()
            started = time.perf_counter()
            save_checkpoint(run.dir, step, tensors=checkpoint_tensors(pm, optimizer), state=state(), keep=2)
            sync_blocked.append(time.perf_counter() - started)
        pending = None
        for _ in range(saves + 1):
            blocked = 0.0
            if pending is not None:
                started = time.perf_counter()
                pending.finish()
                blocked += time.perf_counter() - started
            if len(async_extra) == saves:
                break
            started = time.perf_counter()
            pending = save_checkpoint_async(run.dir, step, tensors=checkpoint_tensors(pm, optimizer), state=state(),
                                            keep=2, process_group=None)  # one process
            blocked += time.perf_counter() - started
            extra = sum(one_step() - plain for _ in range(steps_between))  # beside the background write
            async_blocked.append(blocked)
            async_extra.append(extra)
        size = sum(p.stat().st_size for p in (run.dir / "checkpoints").rglob("*") if p.is_file()) / 2
    return {
        "preset": preset, "checkpoint_mb": round(size / 2**20, 1), "plain_step_s": round(plain, 4),
        "sync_blocked_s": round(statistics.median(sync_blocked), 4),
        "async_blocked_s": round(statistics.median(async_blocked), 4),
        "async_extra_step_time_s": round(statistics.median(async_extra), 4),
        "saves": saves, "steps_between": steps_between,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="demo")
    parser.add_argument("--saves", type=int, default=5)
    parser.add_argument("--steps-between", type=int, default=4)
    args = parser.parse_args()
    print(json.dumps(measure(args.preset, args.saves, args.steps_between)))


if __name__ == "__main__":
    main()
