"""Fault injection for tests and drills: `SHARDWISE_FAULT="ACTION@STEP[:RANK],..."`.

    kill@5:1       rank 1 kills itself with SIGKILL as step 5 starts (a crashed node)
    stop@5:1       rank 1 stops itself with SIGSTOP as step 5 starts (a stalled rank)
    nan@3          the loss of step 3 is NaN on every rank (non-finite gradients follow)
    save_kill@4:0  rank 0 is killed during the save of step 4, after the data, before the manifest
    async_save_kill@4:0  rank 0 is killed while checkpoint.async_save writes step 4 in the background
    term@5:1       rank 1 sends itself SIGTERM as step 5 starts (a pre-emption reaching one rank)
    usr1@5         every rank sends itself SIGUSR1 as step 5 starts (Slurm's `--signal=USR1@T` warning)
    term_launcher@5:0  rank 0 sends SIGTERM to its parent, the `--nproc` launcher (a pre-empted job)
    raise@5:1      rank 1 raises RuntimeError as step 5 starts (a bug: its traceback, and only its, is shown)
    bad_input@5:1  rank 1 raises ValueError as step 5 starts (a user error found late: one line, once)

Each fault fires once per run directory (a marker file records it), so a run restarted after
an injected kill goes on past that step as a real job would. Without the variable nothing here
runs beyond one environment lookup.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass
from pathlib import Path

ENV = "SHARDWISE_FAULT"
ACTIONS = ("kill", "stop", "nan", "save_kill", "async_save_kill", "term", "usr1", "term_launcher", "raise", "bad_input")
FIRED_FILE = ".faults_fired"


@dataclass(frozen=True)
class Fault:
    action: str
    step: int
    rank: int | None  # None: every rank


def parse(text: str) -> list[Fault]:
    faults = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        action, _, where = item.partition("@")
        step, _, rank = where.partition(":")
        if action not in ACTIONS or not step.isdigit() or (rank and not rank.isdigit()):
            raise ValueError(f"{ENV} = {text!r} is invalid at {item!r}: use ACTION@STEP[:RANK] with ACTION one of "
                             f"{', '.join(ACTIONS)}")
        faults.append(Fault(action, int(step), int(rank) if rank else None))
    return faults


def planned() -> list[Fault]:
    return parse(os.environ.get(ENV, ""))


def take(action: str, step: int, rank: int, run_dir: Path) -> bool:
    """Whether fault `action` fires now on this rank (and mark it fired for the run)."""
    for fault in planned():
        if fault.action != action or fault.step != step or fault.rank not in (None, rank):
            continue
        key = f"{action}@{step}:{rank}"  # per rank: a fault on every rank fires on each
        marker = Path(run_dir) / FIRED_FILE
        if marker.is_file() and key in marker.read_text().split():
            return False
        with open(marker, "a") as handle:
            handle.write(key + "\n")
        return True
    return False


def at_step_start(step: int, rank: int, run_dir: Path) -> None:
    if take("kill", step, rank, run_dir):
        os.kill(os.getpid(), signal.SIGKILL)
    if take("stop", step, rank, run_dir):
        os.kill(os.getpid(), signal.SIGSTOP)
    if take("term", step, rank, run_dir):
        os.kill(os.getpid(), signal.SIGTERM)
    if take("usr1", step, rank, run_dir):
        os.kill(os.getpid(), signal.SIGUSR1)
    if take("term_launcher", step, rank, run_dir):
        os.kill(os.getppid(), signal.SIGTERM)
    if take("raise", step, rank, run_dir):
        raise RuntimeError(f"{ENV}: injected error at step {step} on rank {rank}")
    if take("bad_input", step, rank, run_dir):
        raise ValueError(f"{ENV} = bad_input@{step} is invalid: an injected user error on rank {rank}")


def during_save(step: int, rank: int, run_dir: Path) -> None:
    if take("save_kill", step, rank, run_dir):
        os.kill(os.getpid(), signal.SIGKILL)


def during_async_save(step: int, rank: int, run_dir: Path) -> None:
    if take("async_save_kill", step, rank, run_dir):
        os.kill(os.getpid(), signal.SIGKILL)


def poisons_loss(step: int, rank: int, run_dir: Path) -> bool:
    return take("nan", step, rank, run_dir)
