"""The run context: one process's part of a training run, built once at set-up and passed down.

    with open_run_context(cfg) as context:   # train() does this, around everything else
        run = set_up(cfg, context)            # the layout, data and run directory (train/setup.py)
        ...
        context.step_starting(step)           # the flight recorder's step, injected faults
        context.progress(step)                # the launcher's stall watchdog sees the step done

It holds who this process is (rank, world size, device) and what watches it: the heartbeat the
launcher's stall watchdog reads (runtime/heartbeat.py), the flight recorder of its last collectives
(observe/flight_recorder.py), the stop signals and the request they recorded
(runtime/preemption.py), the faults injected for drills (runtime/faults.py) and the gloo group
asynchronous checkpoint saves write through (checkpoint/store.py). The launcher's environment
(RANK, WORLD_SIZE, LOCAL_RANK, the heartbeat directory, SHARDWISE_FAULT) is read once, by
`runtime.launch.rank_environment`, here; nothing below reads it, and nothing of a run lives in a
module: two runs in one process (tests, a worker pool's jobs) share nothing and reset nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from shardwise.config.schema import Config
from shardwise.models.common.attention import attention_kernel_order
from shardwise.observe.flight_recorder import FlightRecorder, capacity_of, recording
from shardwise.runtime.faults import FaultPlan
from shardwise.runtime.heartbeat import Heartbeat
from shardwise.runtime.launch import RankEnvironment, rank_environment
from shardwise.runtime.preemption import StopSignals, StoppedByLauncher
from shardwise.runtime.process_group import init_distributed
from shardwise.train.run_lock import RunLock


@dataclass(kw_only=True)
class RunContext:
    """Who this process is in the run, and what watches it (see the module docstring)."""

    rank: int
    world_size: int
    device: torch.device
    run_dir: Path
    recorder: FlightRecorder
    stop_signals: StopSignals
    """Their handler records a stop request in `stop_signals.received`."""
    faults: FaultPlan
    heartbeat: Heartbeat | None = None
    """Under a launcher's stall watchdog (`shardwise train --nproc` with train.stall_timeout_s > 0)."""
    checkpoint_group: dist.ProcessGroup | None = None
    """A gloo group of all ranks for asynchronous checkpoint writes (checkpoint.async_save with a process
    group), apart from the group the training step uses."""
    run_lock: RunLock | None = None
    """The run directory's lock (train/run_lock.py) of a one-process run, taken at set-up once every
    check passed and released when the context closes; None in a rank of a launched job (its launcher
    holds the lock)."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def step_starting(self, step: int) -> None:
        """The collectives from here on belong to `step`; an injected fault planned for it fires now."""
        self.recorder.step = step
        self.faults.at_step_start(step)

    def progress(self, step: int | None = None) -> None:
        """Tell the launcher's stall watchdog this rank made progress (finished `step`); nothing without one."""
        if self.heartbeat is not None:
            self.heartbeat.progress(step)


@contextlib.contextmanager
def open_run_context(cfg: Config, launched: RankEnvironment | None = None) -> Iterator[RunContext]:
    """This process's run context for the duration of the run: stop signals taken, the heartbeat
    beating (before the process group is joined, so a rank stuck joining is seen), the process group
    joined, every collective recorded. `launched`: what the launcher said (default: read from the
    environment). A step that fails because a peer went away while the launcher stops the job is
    raised as `StoppedByLauncher`, which the CLI ends quietly."""
    launched = launched if launched is not None else rank_environment()
    with (StopSignals(cfg.train.preempt_signals) as stop_signals, beating(launched) as heartbeat,
          RunLock(cfg.run.dir) if launched.world_size == 1 else contextlib.nullcontext() as run_lock):
        device, rank, world_size = init_distributed(cfg.train.device, launched)
        faults = FaultPlan.of(launched.faults, rank, cfg.run.dir, launched.node_local)
        recorder = FlightRecorder(rank, cfg.run.dir, capacity_of(launched.recorder_capacity), node=launched.node_name)
        with recording(recorder, heartbeat), attention_kernel_order(device):
            context = RunContext(rank=rank, world_size=world_size, device=device, run_dir=Path(cfg.run.dir),
                                 recorder=recorder, stop_signals=stop_signals, faults=faults, heartbeat=heartbeat,
                                 checkpoint_group=checkpoint_group(cfg, world_size), run_lock=run_lock)
            try:
                yield context
            except Exception as err:
                signal_name = stop_signals.stop_after(err) if launched.world_size > 1 else None
                if signal_name is not None:
                    raise StoppedByLauncher(signal_name) from err
                raise


@contextlib.contextmanager
def beating(launched: RankEnvironment) -> Iterator[Heartbeat | None]:
    """This rank's heartbeat while inside, when the launcher watches for stalls; else None."""
    if launched.heartbeat_dir is None:
        yield None
        return
    heartbeat = Heartbeat(launched.heartbeat_dir, launched.rank, launched.heartbeat_interval_s).start()
    try:
        yield heartbeat
    finally:
        heartbeat.stop()


def checkpoint_group(cfg: Config, world_size: int) -> dist.ProcessGroup | None:
    """The gloo group asynchronous saves write through: made collectively here, at set-up, by every rank
    (a default group destroyed at the end of a job takes it along, as the test pools do)."""
    if world_size > 1 and cfg.checkpoint.async_save:
        return dist.new_group(backend="gloo")
    return None
