"""run.profile_steps = "A-B": a `torch.profiler` trace of steps A..B on every rank, and a summary.

Each rank writes `RUN/profile/rank<r>.json`, a Chrome trace that Perfetto (ui.perfetto.dev) and
chrome://tracing open, and `RUN/profile/rank<r>.txt`, the table rank 0 also prints: the operators
that took the most time, then the collectives, each with its share of the profiled wall time.
On CUDA the allocator's history is recorded over the same steps and dumped as
`RUN/profile/rank<r>_memory.pickle`, which pytorch.org/memory_viz opens.

Times are the profiler's own: self time per operator on the CPU (the host thread), and on CUDA
the kernels' device time. Collectives are listed with their inclusive time, each name its own
row: the dispatcher's op (`c10d::allreduce_`, which on gloo enqueues the work and on NCCL launches
it), the backend's work (`gloo:all_reduce` on gloo's thread; on CUDA the NCCL kernels' device time
is added), and the waits of functional collectives (DTensor). The rows overlap, so they are not
summed. A DDP gradient all-reduce started from the autograd engine is waited for inside the
engine's own events, which the trace shows and this table cannot separate.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

COLLECTIVE_PREFIXES = ("c10d::", "_c10d_functional::", "_c10d_functional_autograd::", "_dtensor::", "gloo:",
                       "nccl")  # "nccl": NCCL's work ("nccl:all_reduce") and its kernels ("ncclDevKernel_...")
TOP_OPERATORS = 12
MEMORY_HISTORY_ENTRIES = 100_000


def is_collective(name: str) -> bool:
    return name.startswith(COLLECTIVE_PREFIXES)


class StepProfiler:
    """Starts the profiler as step A starts and writes its files when step B ends; does nothing when
    `steps` is None. Every rank profiles the same steps."""

    def __init__(self, steps: tuple[int, int] | None, run_dir: Path, rank: int, device: torch.device):
        self.first, self.last = steps or (0, -1)
        self.dir = Path(run_dir) / "profile"
        self.rank, self.device = rank, device
        self.profiler: profile | None = None
        self.started = 0.0

    def step_starting(self, step: int) -> None:
        if step != self.first:
            return
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
        if self.device.type == "cuda":
            torch.cuda.memory._record_memory_history(max_entries=MEMORY_HISTORY_ENTRIES)
        self.profiler = profile(activities=activities, record_shapes=True)
        self.profiler.__enter__()
        self.started = time.perf_counter()

    def step_finished(self, step: int) -> str | None:
        """The summary table after the last profiled step (None otherwise)."""
        if self.profiler is None or step != self.last:
            return None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        wall_us = (time.perf_counter() - self.started) * 1e6
        self.profiler.__exit__(None, None, None)
        self.dir.mkdir(parents=True, exist_ok=True)
        trace = self.dir / f"rank{self.rank}.json"
        self.profiler.export_chrome_trace(str(trace))
        if self.device.type == "cuda":
            torch.cuda.memory._dump_snapshot(str(self.dir / f"rank{self.rank}_memory.pickle"))
            torch.cuda.memory._record_memory_history(enabled=None)
        table = summary_table(self.profiler.key_averages(), wall_us, steps=(self.first, self.last),
                              device_time=self.device.type == "cuda")
        text = f"profile of steps {self.first}..{self.last}, rank {self.rank}: {trace}\n{table}"
        (self.dir / f"rank{self.rank}.txt").write_text(text + "\n")
        self.profiler = None
        return text

    def close(self) -> None:
        """A run that ended inside the profiled steps: stop without writing."""
        if self.profiler is not None:
            self.profiler.__exit__(None, None, None)
            self.profiler = None
            if self.device.type == "cuda":
                torch.cuda.memory._record_memory_history(enabled=None)


def summary_table(averages, wall_us: float, *, steps: tuple[int, int], device_time: bool) -> str:
    """Top operators by self time, then every collective, each with calls, time and share of the wall time."""
    def self_us(event) -> float:
        return event.self_device_time_total if device_time else event.self_cpu_time_total

    def collective_us(event) -> float:
        return event.cpu_time_total + (event.self_device_time_total if device_time else 0.0)

    operators = sorted((e for e in averages if not is_collective(e.key)), key=self_us, reverse=True)
    collectives = sorted((e for e in averages if is_collective(e.key) and collective_us(e) > 0),
                         key=collective_us, reverse=True)
    clock = "device" if device_time else "CPU"
    lines = [f"wall time of steps {steps[0]}..{steps[1]}: {wall_us / 1e3:.1f} ms",
             f"{'top operators (self ' + clock + ' time)':<58} {'calls':>7} {'ms':>10} {'share':>7}"]
    lines += [row(e.key, e.count, self_us(e), wall_us) for e in operators[:TOP_OPERATORS]]
    if collectives:
        # Not summed: a dispatcher op (c10d::allreduce_) and the backend work it starts (gloo:all_reduce,
        # on gloo's own thread) are separate rows that overlap in time.
        lines += [f"{'collectives (inclusive time)':<58} {'calls':>7} {'ms':>10} {'share':>7}"]
        lines += [row(e.key, e.count, collective_us(e), wall_us) for e in collectives]
    else:
        lines.append("collectives: none in these steps")
    return "\n".join(lines)


def row(name: str, calls: int, time_us: float, wall_us: float) -> str:
    share = time_us / wall_us if wall_us else 0.0
    return f"  {name[:56]:<56} {calls:>7} {time_us / 1e3:>10.2f} {share:>7.1%}"
