"""Fault injection for tests and drills: `SHARDWISE_FAULT="ACTION@STEP[:RANK],..."`.

    kill@5:1       rank 1 kills itself with SIGKILL as step 5 starts (a crashed node)
    stop@5:1       rank 1 stops itself with SIGSTOP as step 5 starts (a stalled rank)
    nan@3          the loss of step 3 is NaN on every rank (non-finite gradients follow)
    save_kill@4:0  rank 0 is killed during the save of step 4, after the data, before the manifest
    async_save_kill@4:0  rank 0 is killed while checkpoint.async_save writes step 4 in the background
    term@5:1       rank 1 sends itself SIGTERM as step 5 starts (a pre-emption reaching one rank)
    usr1@5         every rank sends itself SIGUSR1 as step 5 starts (Slurm's `--signal=USR1@T` warning)
    int@5          every rank sends itself SIGINT as step 5 starts (Ctrl-C in a one-process run)
    term_launcher@5:0  rank 0 sends SIGTERM to its parent, the `--nproc` launcher (a pre-empted job)
    kill_launcher@5:n1.0  local rank 0 of node 1 SIGKILLs its launcher, and so every rank there (a lost node)
    straggle@5:0   rank 0 sleeps STRAGGLE_S as step 5 starts (a straggler: slow, not frozen; it keeps beating)
    raise@5:1      rank 1 raises RuntimeError as step 5 starts (a bug: its traceback, and only its, is shown)
    bad_input@5:1  rank 1 raises ValueError as step 5 starts (a user error found late: one line, once)

RANK is a global rank, or `n<NODE>.<LOCAL>` (a job on several nodes, whose global ranks are torch's
rendezvous's to give): the rank with that local rank on that node (`--node-rank`).

Each fault fires once per run directory (a marker file records it), so a run restarted after
an injected kill goes on past that step as a real job would. Without the variable nothing here
runs beyond a test of an empty tuple: the variable is read once, by `launch.rank_environment`, and
parsed into the run's `FaultPlan` when its context is built.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

ENV = "SHARDWISE_FAULT"
ACTIONS = ("kill", "stop", "nan", "save_kill", "async_save_kill", "term", "usr1", "int", "term_launcher",
           "kill_launcher", "straggle", "raise", "bad_input")
STRAGGLE_S = 10.0
FIRED_FILE = ".faults_fired"


@dataclass(frozen=True)
class Fault:
    action: str
    step: int
    rank: int | str | None  # None: every rank; "n1.0": node 1's local rank 0


def parse(text: str) -> list[Fault]:
    faults = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        action, _, where = item.partition("@")
        step, _, rank = where.partition(":")
        node_local = rank.startswith("n") and all(part.isdigit() for part in rank[1:].split(".", 1)) and "." in rank
        if action not in ACTIONS or not step.isdigit() or (rank and not rank.isdigit() and not node_local):
            raise ValueError(f"{ENV} = {text!r} is invalid at {item!r}: use ACTION@STEP[:RANK] with ACTION one of "
                             f"{', '.join(ACTIONS)} and RANK a rank or n<NODE>.<LOCAL RANK>")
        faults.append(Fault(action, int(step), rank if node_local else (int(rank) if rank else None)))
    return faults


@dataclass(frozen=True)
class FaultPlan:
    """The faults planned for one rank of a run: parsed once, when the run context is built, from what
    the launcher's environment held (`launch.rank_environment`). With none planned, each check is one
    test of an empty tuple."""

    faults: tuple[Fault, ...]
    rank: int
    run_dir: Path
    node_local: str = ""
    """This rank as n<NODE>.<LOCAL> in a job on several nodes, else ""."""

    @classmethod
    def of(cls, text: str, rank: int, run_dir: Path | str, node_local: str = "") -> FaultPlan:
        return cls(tuple(parse(text)), rank, Path(run_dir), node_local)

    def take(self, action: str, step: int) -> bool:
        """Whether fault `action` fires now on this rank (and mark it fired for the run)."""
        for fault in self.faults:
            if fault.action != action or fault.step != step or fault.rank not in (None, self.rank, self.node_local):
                continue
            # per rank: a fault on every rank fires on each; one named n<NODE>.<LOCAL> fires once for that
            # place, whatever global rank a restart gives it
            key = f"{action}@{step}:{fault.rank if isinstance(fault.rank, str) else self.rank}"
            marker = self.run_dir / FIRED_FILE
            if marker.is_file() and key in marker.read_text().split():
                return False
            with open(marker, "a") as handle:
                handle.write(key + "\n")
            return True
        return False

    def at_step_start(self, step: int) -> None:
        if not self.faults:
            return
        for action, sig in (("kill", signal.SIGKILL), ("stop", signal.SIGSTOP), ("term", signal.SIGTERM),
                            ("usr1", signal.SIGUSR1), ("int", signal.SIGINT)):
            if self.take(action, step):
                os.kill(os.getpid(), sig)
        if self.take("term_launcher", step):
            os.kill(os.getppid(), signal.SIGTERM)
        if self.take("kill_launcher", step):
            os.kill(os.getppid(), signal.SIGKILL)
        if self.take("straggle", step):
            time.sleep(STRAGGLE_S)
        if self.take("raise", step):
            raise RuntimeError(f"{ENV}: injected error at step {step} on rank {self.rank}")
        if self.take("bad_input", step):
            raise ValueError(f"{ENV} = bad_input@{step} is invalid: an injected user error on rank {self.rank}")

    def during_save(self, step: int) -> None:
        if self.take("save_kill", step):
            os.kill(os.getpid(), signal.SIGKILL)

    def during_async_save(self, step: int) -> None:
        if self.take("async_save_kill", step):
            os.kill(os.getpid(), signal.SIGKILL)

    def poisons_loss(self, step: int) -> bool:
        return self.take("nan", step)
