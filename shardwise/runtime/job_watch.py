"""One watchdog for a job on several nodes: every node's launcher sees every rank, through the job's store.

On one machine the launcher reads its ranks' heartbeat files (runtime/heartbeat.py). On several, each
node's launcher runs a `NodeWatch` thread through one launch of the ranks (an attempt) that

- publishes its own ranks' heartbeats to the store each beat, as ages measured on its own clock (the head
  turns them back into times on its clock by when it saw each publication change: no clocks are compared
  across machines);
- on the head only, judges the whole job as the one-machine `Watchdog` does (no rank made progress for
  train.stall_timeout_s: which ranks went quiet, on which node, and each rank's last step), notices a node
  whose launcher stopped answering (a lost node) and a node asking to join (the job grows), and posts the
  attempt's stop;
- on every node, acts on the attempt's stop and on a failure another node posted: its own ranks' last
  collectives go to `RUN/collectives/<node>/`, then its ranks are killed (a stall, a failure, a lost node)
  or asked to save and stop (a grow: train.preempt_signals' first signal, so the job grows at a checkpoint).
  A node whose ranks have not started (in the rendezvous still) is stopped by signalling its own launcher.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

from shardwise.core import exit_status
from shardwise.runtime.collective_files import COLLECTIVES_DIR, save_collectives
from shardwise.runtime.heartbeat import LauncherThread, RankBeat, Watchdog, kill_all_at_once, read_beats
from shardwise.runtime.job_store import JobStore
from shardwise.runtime.launch import child_pids
from shardwise.runtime.node_check import PRESENCE_INTERVAL_S
from shardwise.runtime.nodes import NodeSpec

LOST_AFTER_S = 6 * PRESENCE_INTERVAL_S
"""A node whose presence counter did not move for this long is lost (its launcher died, or its machine)."""


def attempt_key(attempt: int, name: str) -> str:
    return f"attempt/{attempt}/{name}"


class NodeWatch(LauncherThread):
    """Every node's thread for one attempt (see the module's docstring); a context manager around the launch."""

    name = "shardwise-node-watch"

    def __init__(self, store: JobStore, spec: NodeSpec, attempt: int, beat_dir: Path, *, run_dir: Path | None,
                 stall_timeout_s: float, interval: float, grow_signal: signal.Signals):
        super().__init__()
        self.store, self.spec, self.attempt, self.beat_dir = store, spec, attempt, Path(beat_dir)
        self.run_dir, self.interval, self.grow_signal = run_dir, interval, grow_signal
        self.judge = JobJudge(self, stall_timeout_s) if spec.is_head and stall_timeout_s else None
        self.acted: dict | None = None
        """The stop this node acted on (the launcher reads it once the ranks are gone)."""
        self.signalled_self = False
        self.seq = 0
        self.started = time.time()
        self.presence_seen: dict[int, tuple[int, float]] = {}
        """Each node's presence counter and when (this clock) it last changed."""

    def __enter__(self) -> NodeWatch:
        self.store.set(attempt_key(self.attempt, f"node/{self.spec.node_rank}"),
                       {"name": self.spec.node_name, "incarnation": self.store.incarnation})
        return super().__enter__()

    def run(self) -> None:
        while not self.done.wait(self.interval):
            try:
                beats = read_beats(self.beat_dir)
                self.publish(beats)
                stop = self.store.get(attempt_key(self.attempt, "stop")) or self.failure_elsewhere()
                if stop is None and self.spec.is_head:
                    stop = self.head_verdict()
                if stop is not None and self.acted is None:
                    self.act(stop, beats)
            except Exception:  # the head's store went away: the job is ending; the launch ends on its own
                if self.done.is_set():
                    return
                time.sleep(self.interval)

    def publish(self, beats: dict[int, RankBeat]) -> None:
        now, self.seq = time.time(), self.seq + 1
        self.store.set(attempt_key(self.attempt, f"beats/{self.spec.node_rank}"), {
            "seq": self.seq, "node": self.spec.node_name, "spawned": bool(child_pids(os.getpid())),
            "ranks": [{"rank": b.rank, "step": b.step, "beat_age": now - b.beat_time,
                       "progress_age": now - b.progress_time, "finished": b.finished} for b in beats.values()]})

    def failure_elsewhere(self) -> dict | None:
        """Another node's launch ended badly while this one runs: stop here too (the decision is the head's)."""
        for node in self.nodes():
            ended = self.store.get(attempt_key(self.attempt, f"ended/{node}"))
            if node != self.spec.node_rank and ended and ended["code"] != 0:
                return {"why": "failure", "line": ended["line"], "code": ended["code"]}
        return None

    def nodes(self) -> list[int]:
        return [node for node in range(self.spec.max_nodes)
                if self.store.get(attempt_key(self.attempt, f"node/{node}")) is not None]

    def head_verdict(self) -> dict | None:
        stop = self.lost_node() or self.join_request() or (self.judge.stall() if self.judge else None)
        if stop is not None:
            self.store.set(attempt_key(self.attempt, "stop"), stop)
        return stop

    def lost_node(self) -> dict | None:
        lost = self.judge_presence()
        if lost is None:
            return None
        line = lost_node_line(self.store, self.attempt, lost, self.nodes())
        return {"why": "lost", "node": lost, "code": 1, "line": line}

    def judge_presence(self) -> int | None:
        """A node of this attempt whose presence stopped, that did not say it ended."""
        now = time.monotonic()
        for node in self.nodes():
            if self.store.get(attempt_key(self.attempt, f"ended/{node}")) is not None:
                continue
            incarnation = self.store.get(attempt_key(self.attempt, f"node/{node}"))["incarnation"]
            count = self.store.add(f"alive/{node}.{incarnation}", 0)
            seen = self.presence_seen.get(node)
            if seen is None or seen[0] != count:
                self.presence_seen[node] = (count, now)
            elif now - seen[1] > LOST_AFTER_S:
                return node
        return None

    def join_request(self) -> dict | None:
        """A node that is not in this attempt asked to join it: stop at a checkpoint and grow."""
        nodes = self.nodes()
        for node in range(self.spec.max_nodes):
            if node not in nodes and self.store.get(f"join/{node}") == self.attempt:
                name = self.store.get(f"node/{node}", {}).get("host", "?")
                return {"why": "grow", "node": node, "code": 0,
                        "line": f"node {node} ({name}) asked to join: the job grows at the next checkpoint"}
        return None

    def act(self, stop: dict, beats: dict[int, RankBeat]) -> None:
        self.acted = stop
        pids = [beat.pid for beat in beats.values() if not beat.finished and alive(beat.pid)]
        if stop["why"] == "grow":
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, self.grow_signal)
            return
        self.save_collectives(stop, beats)
        kill_all_at_once(pids)
        if not pids:  # the ranks have not started: the launcher waits in the rendezvous
            self.signalled_self = True
            os.kill(os.getpid(), signal.SIGTERM)  # elastic turns it into its SignalException there

    def save_collectives(self, stop: dict, beats: dict[int, RankBeat]) -> None:
        if self.run_dir is None or not beats:
            return
        into = Path(self.run_dir) / COLLECTIVES_DIR / self.spec.node_name
        with contextlib.suppress(OSError):
            save_collectives(self.beat_dir, self.run_dir, list(beats), f"{stop['why']}: {stop['line']}",
                             since=self.started, into=into)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class JobJudge(Watchdog):
    """The head's stall judgement over every node's published heartbeats (the one-machine rule: no rank
    made progress for the timeout; the ranks whose heartbeat went quiet are named, with their node)."""

    def __init__(self, watch: NodeWatch, timeout: float):
        super().__init__(watch.beat_dir, 0, timeout, watch.interval)
        self.watch = watch
        self.seen: dict[int, tuple[int, float]] = {}
        self.node_of: dict[int, str] = {}

    def stall(self) -> dict | None:
        beats, now = self.job_beats(), time.time()
        self.nproc = sum(self.watch.store.get(f"node/{node}", {}).get("nproc", 0) for node in self.watch.nodes())
        line = self.check(beats, now)
        if line is None:
            return None
        return {"why": "stall", "line": line, "code": exit_status.STALLED}

    def job_beats(self) -> dict[int, RankBeat]:
        """Every rank's beat, with times on this clock: when its node's publication last changed, less the
        ages it gave."""
        beats, now = {}, time.time()
        for node in self.watch.nodes():
            body = self.watch.store.get(attempt_key(self.watch.attempt, f"beats/{node}"))
            if body is None:
                continue
            seen = self.seen.get(node)
            if seen is None or seen[0] != body["seq"]:
                self.seen[node] = seen = (body["seq"], now)
            for rank in body["ranks"]:
                self.node_of[rank["rank"]] = body["node"]
                beats[rank["rank"]] = RankBeat(rank["rank"], 0, rank["step"], seen[1] - rank["progress_age"],
                                               seen[1] - rank["beat_age"], rank["finished"])
        return beats

    def rank_label(self, rank: int) -> str:
        return f"{rank} on {self.node_of[rank]}" if rank in self.node_of else str(rank)


def ended_record(code: int, line: str | None, category: int) -> dict:
    """What a node posts when its launch ended: its exit status, its one line, and how sure a cause it is
    (0: a rank killed from outside, 1: a rank that failed, 2: ranks stopped by their agent or a signal)."""
    return {"code": code, "line": line or "", "category": category}


def lost_node_line(store: JobStore, attempt: int, lost: int, nodes: list[int]) -> str:
    """The line naming a lost node and the step the job was in. The same whichever side notices first: the
    head's watch (the node's presence stopped) or the head's end of the attempt (its own ranks failed on the
    lost node's collectives first, as on a loaded host). `nodes`: the attempt's nodes, whose ranks' beats count."""
    steps = [rank["step"] for node in nodes
             for rank in store.get(attempt_key(attempt, f"beats/{node}"), {"ranks": []})["ranks"]]
    during = f" during step {max(steps) + 1}" if steps else ""  # the job's furthest rank: the others wait there
    name = store.get(attempt_key(attempt, f"node/{lost}"))["name"]
    return f"node {lost} ({name}) was lost{during}: its launcher stopped answering"
