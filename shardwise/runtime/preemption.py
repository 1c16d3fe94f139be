"""Orderly stops: a pre-emption signal or Ctrl-C finishes the step, saves, and exits with one line.

Slurm and Kubernetes pre-empt with SIGTERM (Slurm's `--signal=USR1@90` warns with SIGUSR1
before the time limit); `train.preempt_signals` lists the signals taken as "save and stop".
The handler only records the request (in `StopSignals`, which the run context holds). After each
step every rank says whether it saw one (a one-element all-reduce, so a signal that reached a
single rank stops all of them at the same step); then every rank saves that step's checkpoint
and the run ends with `Preempted` (exit status 75, exit_status.PREEMPTED).

Ctrl-C (SIGINT) is always taken the same way, whatever train.preempt_signals says: a person stopping
a run wants the step in flight kept. Its line says "stopped by Ctrl-C" and its exit status is 130
(exit_status.INTERRUPTED, 128 + SIGINT as a shell reports a process ended by Ctrl-C), not 75: a
scheduler's wrapper that reruns a pre-empted job must not rerun one a person stopped. A second Ctrl-C
(or a Ctrl-C after any stop request) ends the process at once with one line: the save in flight, if
any, stays invisible (checkpoints appear by rename, checkpoint/store.py). A Python signal handler runs
between bytecodes, so "at once" waits for the torch op in progress, not for the step.

The same signal is how the elastic agent stops the surviving ranks after one rank died: those
are blocked in a collective with the dead rank, which fails with a "peer lost" error. Such an
error, once a stop was asked for (or within `PEER_LOST_GRACE_S` of it), becomes `StoppedByLauncher`
(train/context.py), and the CLI ends the rank quietly through the signal's default action: the
rank that failed first is the one to report.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import torch
import torch.distributed as dist

from shardwise.config.schema import signals_named
from shardwise.core import exit_status

PEER_LOST_GRACE_S = 10.0
"""How long a rank whose peer vanished waits for the launcher's stop signal before reporting the error itself."""


CTRL_C = signal.SIGINT
"""A person's stop: always taken as "save and stop" (the module docstring says why)."""


class StopSignals:
    """Context manager: while inside, the given signals and Ctrl-C record a stop request in `received`
    instead of ending the process; a Ctrl-C once a stop was asked for ends it at once (`stop_at_once`).
    The run context (train/context.py) holds it; the handler is its bound method, so the request lives
    in this object, not in the module."""

    def __init__(self, names: str):
        self.signals = list(dict.fromkeys([*signals_named("train.preempt_signals", names), CTRL_C]))
        self.previous: dict[signal.Signals, object] = {}
        self.received: str | None = None
        """The name of the first stop signal received while inside (None: none)."""

    def __enter__(self) -> StopSignals:
        self.received = None
        if threading.current_thread() is threading.main_thread():  # signal.signal works there only
            for sig in self.signals:
                self.previous[sig] = signal.signal(sig, self.record)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        self.previous.clear()

    def record(self, signum, frame) -> None:
        """The signal handler: only notes the request (the step in progress finishes first)."""
        if signum == CTRL_C and self.received is not None:
            stop_at_once()
        self.received = self.received or signal.Signals(signum).name

    def agreed(self, distributed: bool) -> str | None:
        """The stop signal if any rank received one, else None: the same words on every rank (whichever
        rank's report the launcher prints first), naming the rank when not all of them received it."""
        if not distributed:
            return self.received
        received = getattr(signal, self.received) if self.received else 0
        # Maxima over ranks: [signal number, a rank that received it, -1 if every rank received it]
        flag = torch.tensor([int(received), dist.get_rank() if received else -1, -1 if received else 0],
                            dtype=torch.int64)
        if dist.get_backend() == "nccl":
            flag = flag.cuda()
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        number, rank, all_received = (int(value) for value in flag.tolist())
        if not number:
            return None
        name = signal.Signals(number).name
        return name if all_received == -1 else f"{name} (received by rank {rank})"

    def stop_after(self, err: BaseException) -> str | None:
        """The stop signal when `err` is this rank's share of a stop (a peer is gone, and a stop was or
        within PEER_LOST_GRACE_S is asked for), else None."""
        if not peer_lost(err):
            return None
        deadline = time.monotonic() + PEER_LOST_GRACE_S
        while self.received is None and time.monotonic() < deadline:
            time.sleep(0.05)
        return self.received


def stop_at_once() -> None:
    """A second Ctrl-C: one line, and this process ends now, without its teardown (which could wait on a
    collective or a background save)."""
    print("shardwise: stopped at once by a second Ctrl-C; the step in flight was not saved: rerun the same "
          "command to resume from the newest checkpoint", file=sys.stderr, flush=True)
    os._exit(exit_status.INTERRUPTED)


def by_hand(signal_name: str) -> bool:
    """Whether a stop request came from a person (Ctrl-C), as `StopSignals.agreed` names it."""
    return signal_name.split()[0] == CTRL_C.name


class Preempted(Exception):
    """The run stopped on a pre-emption signal or Ctrl-C after saving a checkpoint; `exit_status` is
    exit_status.PREEMPTED, or exit_status.INTERRUPTED for Ctrl-C."""

    def __init__(self, signal_name: str, step: int, checkpoint):
        self.signal_name, self.step, self.checkpoint = signal_name, step, checkpoint
        self.exit_status = exit_status.INTERRUPTED if by_hand(signal_name) else exit_status.PREEMPTED
        # A Ctrl-C reaches the launcher, which passes it on: which rank had it when the ranks agreed on
        # the step is chance (the other's copy may land a moment later) and says nothing to a person.
        stopped = "stopped by Ctrl-C (SIGINT)" if by_hand(signal_name) else f"pre-empted by {signal_name}"
        super().__init__(f"{stopped} after step {step}: saved checkpoint {checkpoint}; "
                         "rerun the same command to resume from it")


PEER_LOST_MARKERS = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "Socket closed",
                     "NCCL communicator was aborted", "ProcessGroupNCCL is aborted")


def peer_lost(err: BaseException) -> bool:
    """Whether `err` says another rank went away (not a fault of this rank)."""
    if isinstance(err, getattr(dist, "DistError", ())):
        return True
    return isinstance(err, RuntimeError) and any(marker in str(err) for marker in PEER_LOST_MARKERS)


class StoppedByLauncher(Exception):
    """A launched rank's step failed because a peer went away while the launcher was stopping the job
    (raised by the run context in place of that error): the rank ends quietly (`exit_quietly`), the rank
    that failed first is the one to report."""

    def __init__(self, signal_name: str):
        self.signal_name = signal_name
        super().__init__(f"stopped by {signal_name} after a peer went away")


def stopped_by_launcher(err: BaseException) -> bool:
    """Whether `err` is this rank's share of a stop (`StoppedByLauncher`)."""
    return isinstance(err, StoppedByLauncher)


def exit_quietly(signal_name: str) -> None:
    """End this process by the stop signal's default action, printing nothing (its exit status says how)."""
    sys.stderr.flush()
    sig = getattr(signal, signal_name, signal.SIGTERM)
    if not isinstance(sig, signal.Signals) or sig == signal.SIGUSR1:
        sig = signal.SIGTERM  # USR1's default action would also end it, but "terminated" reads right
    signal.signal(sig, signal.SIG_DFL)
    os.kill(os.getpid(), sig)
    time.sleep(5)  # the signal is delivered at once; never return into the handler chain
    os._exit(128 + int(sig))
