"""Heartbeats: how the launcher tells a stalled rank from a slow one (train.stall_timeout_s).

Each rank started by `shardwise train --nproc N` runs a thread that rewrites
`$SHARDWISE_HEARTBEAT_DIR/rank<R>.json` every `interval` seconds with its pid, the last step
it finished and when it last made progress (a step, a save, its setup: `progress`). The
thread keeps beating while the rank waits in a collective, and stops when the process is
frozen (SIGSTOP, a hung driver call holding the GIL), so the launcher's `Watchdog` can say
both *that* the job stalled (no rank made progress for the timeout) and *which* rank did
it (its heartbeat went quiet; with every heartbeat alive, the ranks are deadlocked waiting
for each other and all are named). Without the variable (a plain one-process run, torchrun)
nothing here runs.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

DIR_ENV = "SHARDWISE_HEARTBEAT_DIR"
STARTUP_ALLOWANCE_S = 120.0
"""Until every rank has beaten once (imports, process-group setup) the limit is at least this long,
so that a short train.stall_timeout_s is not spent on starting Python on a loaded node."""
INTERVAL_ENV = "SHARDWISE_HEARTBEAT_INTERVAL"


class Heartbeat:
    """The rank side: a daemon thread writing this rank's heartbeat file."""

    def __init__(self, directory: Path, rank: int, interval: float):
        self.path = Path(directory) / f"rank{rank}.json"
        self.interval = interval
        self.step = 0
        self.progress_time = time.time()
        self.stopped = threading.Event()
        self.lock = threading.Lock()  # the step loop and the thread both write
        self.thread = threading.Thread(target=self.run, name="shardwise-heartbeat", daemon=True)

    def progress(self, step: int | None = None) -> None:
        if step is not None:
            self.step = step
        self.progress_time = time.time()
        self.write()  # now, not at the next beat: a rank frozen right after still shows this step

    def write(self) -> None:
        body = {"pid": os.getpid(), "step": self.step, "progress_time": self.progress_time, "beat_time": time.time()}
        with self.lock:
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps(body))
            os.replace(tmp, self.path)  # the launcher never reads half a file

    def run(self) -> None:
        while not self.stopped.wait(self.interval):
            try:
                self.write()
            except OSError:  # the launcher's directory is gone: the job is over
                return


_beat: Heartbeat | None = None


def start(rank: int) -> None:
    """Start beating if the launcher asked for heartbeats (idempotent)."""
    global _beat
    directory = os.environ.get(DIR_ENV)
    if _beat is not None or not directory:
        return
    _beat = Heartbeat(Path(directory), rank, float(os.environ.get(INTERVAL_ENV, "1")))
    _beat.write()
    _beat.thread.start()


def progress(step: int | None = None) -> None:
    """Mark progress (and the last finished step); nothing when no launcher watches."""
    if _beat is not None:
        _beat.progress(step)


@dataclass
class RankBeat:
    rank: int
    pid: int
    step: int
    progress_time: float
    beat_time: float


def read_beats(directory: Path) -> dict[int, RankBeat]:
    beats = {}
    for path in Path(directory).glob("rank*.json"):
        try:
            body = json.loads(path.read_text())
            rank = int(path.stem.removeprefix("rank"))
        except (OSError, ValueError):
            continue  # replaced while read: the next look sees it
        beats[rank] = RankBeat(rank, body["pid"], body["step"], body["progress_time"], body["beat_time"])
    return beats


class Watchdog:
    """The launcher side: a thread that SIGKILLs the ranks once no rank made progress for `timeout`
    seconds, and leaves `verdict`, the one line that says which rank stalled and where each was."""

    def __init__(self, directory: Path, nproc: int, timeout: float, interval: float):
        self.directory, self.nproc, self.timeout, self.interval = Path(directory), nproc, timeout, interval
        self.started = time.time()
        self.verdict: str | None = None
        self.done = threading.Event()
        self.thread = threading.Thread(target=self.run, name="shardwise-watchdog", daemon=True)

    def __enter__(self) -> Watchdog:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.done.set()
        self.thread.join()

    def run(self) -> None:
        while not self.done.wait(self.interval):
            beats = read_beats(self.directory)
            verdict = self.check(beats, time.time())
            if verdict:
                self.verdict = verdict
                for beat in beats.values():
                    try:
                        os.kill(beat.pid, signal.SIGKILL)  # a frozen rank answers nothing gentler
                    except ProcessLookupError:
                        pass
                return

    def check(self, beats: dict[int, RankBeat], now: float) -> str | None:
        """The verdict if the job stalled, else None."""
        last_progress = max([self.started, *(beat.progress_time for beat in beats.values())])
        limit = self.timeout if len(beats) == self.nproc else max(self.timeout, STARTUP_ALLOWANCE_S)
        if now - last_progress <= limit:
            return None
        silent = sorted(rank for rank in range(self.nproc)
                        if rank not in beats or now - beats[rank].beat_time > max(3 * self.interval, 2.0))
        where = ", ".join(f"rank {rank} step {beats[rank].step}" if rank in beats else f"rank {rank} not started"
                          for rank in range(self.nproc))
        waited = f"no rank made progress for {now - last_progress:.0f} s (train.stall_timeout_s = {self.timeout:g})"
        if silent:
            names = ", ".join(map(str, silent))
            return (f"rank{'s' if len(silent) > 1 else ''} {names} stalled (process not responding): {waited}; "
                    f"last step finished: {where}")
        return f"the ranks are deadlocked (all alive, none progressing): {waited}; last step finished: {where}"
