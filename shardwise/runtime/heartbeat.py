"""Heartbeats: how the launcher tells a stalled rank from a slow one (train.stall_timeout_s).

Each rank started by `shardwise train --nproc N` runs a thread that rewrites
`$SHARDWISE_HEARTBEAT_DIR/rank<R>.json` every `interval` seconds with its pid, the last step
it finished and when it last made progress (a step, a save, its setup: `progress`). The
thread keeps beating while the rank waits in a collective, and stops when the process is
frozen (SIGSTOP, a hung driver call holding the GIL), so the launcher's `Watchdog` can say
both *that* the job stalled (no rank made progress for the timeout) and *which* rank did
it (its heartbeat went quiet; with every heartbeat alive, the ranks are deadlocked waiting
for each other and all are named). Without the variable (a plain one-process run, torchrun)
nothing here runs. The variables are read once, by `launch.rank_environment`; the run context
(train/context.py) holds the rank's `Heartbeat`.

The beat also carries the rank's flight recorder (observe/flight_recorder.py, which hooks in
with `Heartbeat.add_hook`: this layer does not import `observe`): each beat it leaves the rank's
last collectives beside the heartbeat, and the launcher copies every rank's into
`RUN/collectives/` with a `summary.txt` when it stops a stalled job or a rank fails
(`collective_files.save_collectives`), so a hang can be read after the fact. The thread is what makes that
work for a hang: it keeps writing while the main thread waits in the collective.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from shardwise.runtime.collective_files import save_collectives, write_text_atomic

DIR_ENV = "SHARDWISE_HEARTBEAT_DIR"
STARTUP_ALLOWANCE_S = 120.0
"""Until every rank has beaten once (imports, process-group setup) the limit is at least this long,
so that a short train.stall_timeout_s is not spent on starting Python on a loaded node."""
INTERVAL_ENV = "SHARDWISE_HEARTBEAT_INTERVAL"


BeatHook = Callable[[Path], None]
"""Called with the heartbeat directory on each beat (the heartbeat thread) and at each `progress` (the caller's)."""


class Heartbeat:
    """The rank side: a daemon thread writing this rank's heartbeat file, from `start` to `stop` (the run
    context's lifetime, train/context.py, which makes one when the launcher named a directory)."""

    def __init__(self, directory: Path, rank: int, interval: float):
        self.path = Path(directory) / f"rank{rank}.json"
        self.interval = interval
        self.step = 0
        self.progress_time = time.time()
        self.hooks: list[BeatHook] = []
        self.stopped = threading.Event()
        self.lock = threading.Lock()  # the step loop and the thread both write
        self.thread = threading.Thread(target=self.run, name="shardwise-heartbeat", daemon=True)

    def start(self) -> Heartbeat:
        self.write()
        self.thread.start()
        return self

    def stop(self) -> None:
        """End the beat, leaving a last one marked finished: a rank whose run ended is not frozen, so a
        watchdog that later finds no progress (another rank frozen after the last step) does not name it."""
        self.stopped.set()
        if self.thread.is_alive():
            self.thread.join()
        try:
            self.write(finished=True)
        except OSError:  # the launcher's directory is gone: the job is over
            pass

    def add_hook(self, hook: BeatHook) -> None:
        """Run `hook(directory)` on every beat and progress from now on (for layers above: the flight recorder)."""
        if hook not in self.hooks:
            self.hooks.append(hook)

    def remove_hook(self, hook: BeatHook) -> None:
        if hook in self.hooks:
            self.hooks.remove(hook)

    def progress(self, step: int | None = None) -> None:
        """Mark progress (and the last finished step)."""
        if step is not None:
            self.step = step
        self.progress_time = time.time()
        self.write()  # now, not at the next beat: a rank frozen right after still shows this step
        self.run_hooks()  # and its collectives up to here (the flight recorder: about 1 ms for a full ring)

    def write(self, finished: bool = False) -> None:
        body = {"pid": os.getpid(), "step": self.step, "progress_time": self.progress_time, "beat_time": time.time(),
                "finished": finished}
        with self.lock:
            write_text_atomic(self.path, json.dumps(body))

    def run(self) -> None:
        while not self.stopped.wait(self.interval):
            try:
                self.write()
            except OSError:  # the launcher's directory is gone: the job is over
                return
            self.run_hooks()

    def run_hooks(self) -> None:
        for hook in list(self.hooks):
            try:
                hook(self.path.parent)
            except Exception as err:  # a hook's bug must not stop the beat: the watchdog would call this rank frozen
                self.remove_hook(hook)
                print(f"shardwise: warning: heartbeat hook {getattr(hook, '__qualname__', hook)} failed and was "
                      f"dropped: {type(err).__name__}: {err}", file=sys.stderr, flush=True)


@dataclass
class RankBeat:
    rank: int
    pid: int
    step: int
    progress_time: float
    beat_time: float
    finished: bool = False
    """The rank's run ended (its last beat): its silence is no stall."""


def kill_all_at_once(pids: list[int]) -> None:
    """SIGKILL every rank (a frozen one answers nothing gentler), after SIGSTOPping them all: a stopped
    process keeps its sockets open, so no rank sees a peer die and writes its own last collectives over
    the copies the watchdog has just saved (seen once under load: killed one by one, a rank waiting in
    an all-reduce saw the connection reset and dumped its failed collective before its own kill)."""
    for sig in (signal.SIGSTOP, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass


def read_beats(directory: Path) -> dict[int, RankBeat]:
    beats = {}
    for path in Path(directory).glob("rank*.json"):
        try:
            body = json.loads(path.read_text())
            rank = int(path.stem.removeprefix("rank"))
        except (OSError, ValueError):
            continue  # replaced while read: the next look sees it
        beats[rank] = RankBeat(rank, body["pid"], body["step"], body["progress_time"], body["beat_time"],
                               body.get("finished", False))
    return beats


class LauncherThread:
    """A launcher's daemon thread running `run` for the duration of a `with` block (one launch of the ranks)."""

    name = "shardwise-launcher-thread"

    def __init__(self):
        self.done = threading.Event()
        self.thread = threading.Thread(target=self.run, name=self.name, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.done.set()
        self.thread.join()

    def run(self) -> None:
        raise NotImplementedError


class Watchdog(LauncherThread):
    """The launcher side: a thread that SIGKILLs the ranks once no rank made progress for `timeout`
    seconds, and leaves `verdict`, the one line that says which rank stalled and where each was.
    With `run_dir`, each rank's last collectives are saved there first (`save_collectives`)."""

    name = "shardwise-watchdog"

    def __init__(self, directory: Path, nproc: int, timeout: float, interval: float, run_dir: Path | None = None):
        super().__init__()
        self.directory, self.nproc, self.timeout, self.interval = Path(directory), nproc, timeout, interval
        self.run_dir = run_dir
        self.started = time.time()
        self.verdict: str | None = None

    def run(self) -> None:
        while not self.done.wait(self.interval):
            beats, now = read_beats(self.directory), time.time()
            verdict = self.check(beats, now)
            if verdict:
                saved = self.save_collectives(verdict, beats, now)
                note = f"; each rank's last collectives: {saved}" if saved else ""
                # Set before the kill: the launcher reads it as soon as the ranks are dead.
                self.verdict = self.check(beats, now, note)
                kill_all_at_once([beat.pid for beat in beats.values()])
                return

    def check(self, beats: dict[int, RankBeat], now: float, note: str = "") -> str | None:
        """The verdict if the job stalled, else None; `note` goes before where each rank was."""
        if len(beats) == self.nproc and all(beat.finished for beat in beats.values()):
            return None  # every run ended: the ranks are exiting (slowly on a busy machine), not stalled
        last_progress = max([self.started, *(beat.progress_time for beat in beats.values())])
        limit = self.timeout if len(beats) == self.nproc else max(self.timeout, STARTUP_ALLOWANCE_S)
        if now - last_progress <= limit:
            return None
        silent = self.silent_ranks(beats, now)
        where = ", ".join(self.where(rank, beats) for rank in range(self.nproc))
        waited = f"no rank made progress for {now - last_progress:.0f} s (train.stall_timeout_s = {self.timeout:g})"
        if silent:
            names = ", ".join(map(self.rank_label, silent))
            return (f"rank{'s' if len(silent) > 1 else ''} {names} stalled (process not responding): {waited}{note}; "
                    f"last step finished: {where}")
        return (f"the ranks are deadlocked (all alive, none progressing): {waited}{note}; "
                f"last step finished: {where}")

    def rank_label(self, rank: int) -> str:
        """How the verdict names a rank (a job on several nodes adds the node: runtime/job_watch.py)."""
        return str(rank)

    @staticmethod
    def where(rank: int, beats: dict[int, RankBeat]) -> str:
        if rank not in beats:
            return f"rank {rank} not started"
        return f"rank {rank} step {beats[rank].step}{' (finished)' if beats[rank].finished else ''}"

    def silent_ranks(self, beats: dict[int, RankBeat], now: float) -> list[int]:
        """The ranks whose heartbeat went quiet (frozen, or never started); not those whose run ended."""
        return sorted(rank for rank in range(self.nproc) if rank not in beats or (
            not beats[rank].finished and now - beats[rank].beat_time > max(3 * self.interval, 2.0)))

    def save_collectives(self, verdict: str, beats: dict[int, RankBeat], now: float) -> Path | None:
        if self.run_dir is None:
            return None
        try:
            frozen = {rank: "its heartbeat went quiet (frozen)" for rank in self.silent_ranks(beats, now)}
            return save_collectives(self.directory, self.run_dir, self.nproc, f"stall: {verdict}", since=self.started,
                                    stopped=frozen)
        except OSError:  # a full or vanished disk must not keep the watchdog from stopping the job
            return None
