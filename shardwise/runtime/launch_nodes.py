"""A job on several nodes: each node's launcher starts its ranks under torch's elastic agent, joined with the
other nodes' by torch's c10d rendezvous at the head's endpoint, and the head decides, for the whole job,
what happens after each launch (an attempt) ends.

Attempts: every node launches attempt k as rendezvous run `<job>-k`, so a restart is a fresh rendezvous that
no node of an earlier attempt can confuse. While it runs, each node's `NodeWatch` (runtime/job_watch.py)
publishes its ranks' heartbeats and acts on the attempt's stop. When a node's launch ends it posts how
(`ended/<node>`); the head waits for every node of the attempt to end (or to be lost), then posts one
decision that every node follows:

    done       every rank finished
    restart    a failure that may be retried (the one-machine rules: not bad input, a diverged run or a
               pre-emption; train.max_restarts), or a grow; every node launches attempt k+1, which resumes
               from the newest checkpoint. With --nnodes MIN:MAX the rendezvous waits train.rejoin_timeout_s
               for a lost node before it starts on the nodes left (shrink), and a node that comes back asks
               to join: the ranks save at the next step and the job grows to it (not counted as a restart).
    stop       print the line, end with its exit status, on every node.

The head prints each decision's line; the other nodes print the last one. The one-machine launch
(runtime/launch.py's `launch_local`) is untouched: `--nnodes 1` keeps its messages and exit statuses.
"""

from __future__ import annotations

import math
import re
import signal
import sys
import time
from pathlib import Path

from shardwise.config.schema import signals_named
from shardwise.core import exit_status
from shardwise.runtime import launch
from shardwise.runtime.job_store import JobStore
from shardwise.runtime.job_watch import LOST_AFTER_S, NodeWatch, attempt_key, ended_record, lost_node_line
from shardwise.runtime.launch import NODE_RANK_ENV, Launch, Rendezvous, first_failure, outcome
from shardwise.runtime.node_check import node_alive
from shardwise.runtime.nodes import NodeSpec



def launch_nodes(store: JobStore, spec: NodeSpec, nproc: int, argv: list[str], module: str = "shardwise.train", *,
                 max_restarts: int = 0, run_dir: Path | None = None, stop_signals: str = "",
                 stall_timeout_s: float = 0.0, rejoin_timeout_s: float = 30.0) -> int:
    """Run this node's `nproc` ranks for the whole job; 0, or the exit status of the job's decisive failure."""
    attempt = current_attempt(store, spec)
    restarts = store.get("restarts", 0)
    grow = grow_signal(stop_signals)
    while True:
        rendezvous = Rendezvous(
            endpoint=spec.endpoint, run_id=f"{spec.job_id}-{attempt}", min_nodes=spec.min_nodes,
            max_nodes=spec.max_nodes, node_name=spec.node_name,
            configs={"is_host": spec.is_head, "join_timeout": math.ceil(spec.rdzv_timeout_s),
                     "last_call_timeout": max(1, math.ceil(rejoin_timeout_s))})

        watches: list[NodeWatch] = []

        def watch(beats: Path, interval: float, attempt=attempt):
            watches.append(NodeWatch(store, spec, attempt, beats, run_dir=run_dir, stall_timeout_s=stall_timeout_s,
                                     interval=interval, grow_signal=grow))
            return watches[-1]

        env = {NODE_RANK_ENV: str(spec.node_rank)}
        result = launch.launch_once(nproc, argv, module, stop_signals=stop_signals, stall_timeout_s=stall_timeout_s,
                                    run_dir=run_dir, rendezvous=rendezvous, watch=watch, extra_env=env)
        if result.failure is not None:
            release_exit_barrier(store, rendezvous.run_id)
        acted = watches[0].acted if watches else None
        store.set(attempt_key(attempt, f"ended/{spec.node_rank}"), ended_of(result, run_dir, spec, acted))
        decision = decide(store, spec, attempt, restarts, max_restarts) if spec.is_head else \
            await_decision(store, spec, attempt)
        if decision["action"] != "restart":
            if decision["line"] and (decision["action"] == "stop" or not spec.is_head):
                print(decision["line"], file=sys.stderr, flush=True)
            if spec.is_head:
                wait_for_acknowledgements(store, spec, attempt)
            return decision["code"]
        restarts = decision["restarts"]
        attempt += 1


EXIT_BARRIER_KEY = "torch.rendezvous.{run_id}.0/torchelastic/agent/terminal_state/last_member"
"""Where torch's elastic agents meet once their ranks succeeded (`SimpleElasticAgent._exit_barrier`: the
rendezvous's store, prefixed with run and round, round 0 for a fresh run id; torch 2.11 to 2.13)."""


def release_exit_barrier(store: JobStore, run_id: str) -> None:
    """A node whose launch failed will not reach torch's exit barrier, where the agents of the nodes whose ranks
    succeeded (a server's followers, ranks that finished before the failure) would wait 5 minutes for it:
    mark the barrier complete for them. The head's decision, which they then wait for, says what happened."""
    with store.lock:
        store.store.set(EXIT_BARRIER_KEY.format(run_id=run_id), "<released: another node failed>")


def grow_signal(stop_signals: str) -> signal.Signals:
    """How the ranks are asked to save and stop when the job grows: the first train.preempt_signals signal."""
    named = signals_named("train.preempt_signals", stop_signals)
    return named[0] if named else signal.SIGTERM


def current_attempt(store: JobStore, spec: NodeSpec) -> int:
    """The attempt this node launches first: the head starts attempt 0; a node joins the running attempt while
    its ranks have not started (its rendezvous is still open), else asks the head to grow the job and joins
    the next."""
    if spec.is_head:
        store.set("attempt", 0)
        return 0
    running = store.poll("attempt", spec.rdzv_timeout_s, default=0)
    decision = store.get(attempt_key(running, "decision"))
    if decision is not None:
        return running + 1 if decision["action"] == "restart" else ended_already(decision)
    if not ranks_started(store, spec, running):
        return running
    store.set(f"join/{spec.node_rank}", running)
    print(f"shardwise: node {spec.node_rank} joins the running job: the job grows at its next checkpoint",
          file=sys.stderr, flush=True)
    decision = await_decision(store, spec, running)
    return running + 1 if decision["action"] == "restart" else ended_already(decision)


def ranks_started(store: JobStore, spec: NodeSpec, attempt: int) -> bool:
    """Whether `attempt`'s rendezvous completed: some node's agent has started its ranks (a node arriving after
    that would be a membership change inside torch's agent, which restarts on its own terms: it asks to grow)."""
    return any((store.get(attempt_key(attempt, f"beats/{node}")) or {}).get("spawned")
               for node in range(spec.max_nodes))


def ended_already(decision: dict) -> int:
    print(f"shardwise: the job ended before this node could join{': ' + decision['line'] if decision['line'] else ''}",
          file=sys.stderr, flush=True)
    raise SystemExit(decision["code"])


def ended_of(result: Launch, run_dir: Path | None, spec: NodeSpec, acted: dict | None) -> dict:
    """What this node posts when its launch ended (runtime/job_watch.py's `ended_record`): its ranks stopped by
    its own watch (`acted`: for a stall, a lost node or another node's failure) are no cause of their own."""
    if result.failure is None:
        return ended_record(0, None, 3)
    line, code = outcome(result, run_dir)
    line = re.sub(r"^(shardwise: )?rank (\d+)", rf"\g<1>rank \2 on {spec.node_name}", line, count=1)
    if acted is not None or launch.is_signal_to_launcher(result):
        return ended_record(code, line, 2)
    failure = first_failure(result.failure)[1]
    category = 2 if failure.exitcode == -signal.SIGTERM else (0 if failure.exitcode < 0 else 1)
    return ended_record(code, line, category)


def decide(store: JobStore, spec: NodeSpec, attempt: int, restarts: int, max_restarts: int) -> dict:
    """The head's decision once every node of `attempt` ended or was lost."""
    ended = gather_ends(store, spec, attempt)
    stop = store.get(attempt_key(attempt, "stop"))
    failures = [record for record in ended.values() if record["code"] != 0]
    if stop is None and not failures:
        decision = {"action": "done", "line": "", "code": 0, "restarts": restarts}
    elif stop is not None and stop["why"] == "grow":
        decision = {"action": "restart", "code": 0, "restarts": restarts,
                    "line": f"shardwise: {stop['line'].replace('at the next checkpoint', 'from the newest checkpoint')}"}
    else:
        cause = stop if stop is not None and stop["why"] in ("stall", "lost") else \
            min(failures, key=lambda record: record["category"])
        line, code = cause["line"], cause["code"]
        if restarts < max_restarts and code not in exit_status.NO_RESTART:
            restarts += 1
            decision = {"action": "restart", "code": code, "restarts": restarts,
                        "line": f"{prefixed(line)}; restarting from the newest checkpoint (restart {restarts} of "
                                f"{max_restarts})"}
        else:
            decision = {"action": "stop", "code": code, "restarts": restarts,
                        "line": line if line.startswith("shardwise:") else f"shardwise: error: {line}"}
    if decision["action"] == "restart":
        print(decision["line"], file=sys.stderr, flush=True)
        store.set("restarts", decision["restarts"])
        store.set("attempt", attempt + 1)
    store.set(attempt_key(attempt, "decision"), decision)
    return decision


def prefixed(line: str) -> str:
    return line if line.startswith("shardwise:") else f"shardwise: {line}"


def gather_ends(store: JobStore, spec: NodeSpec, attempt: int) -> dict[int, dict]:
    """Each node's end of `attempt`, waiting for those still running; a node that is gone counts as lost."""
    while True:
        nodes = [node for node in range(spec.max_nodes) if store.get(attempt_key(attempt, f"node/{node}"))]
        ended = {node: store.get(attempt_key(attempt, f"ended/{node}")) for node in nodes}
        waiting = [node for node, record in ended.items() if record is None]
        if not waiting:
            return ended
        for node in waiting:
            registered = store.get(attempt_key(attempt, f"node/{node}"))
            if not node_alive(store, node, registered["incarnation"], wait_s=LOST_AFTER_S):
                ended[node] = ended_record(1, lost_node_line(store, attempt, node, nodes), 0)
                store.set(attempt_key(attempt, f"ended/{node}"), ended[node])
        time.sleep(0.1)


ACKNOWLEDGE_WAIT_S = 10.0
"""How long the head keeps the job's store up after its last decision, for the nodes to read it."""


def wait_for_acknowledgements(store: JobStore, spec: NodeSpec, attempt: int) -> None:
    nodes = [node for node in range(1, spec.max_nodes) if store.get(attempt_key(attempt, f"node/{node}"))]
    deadline = time.monotonic() + ACKNOWLEDGE_WAIT_S
    while store.add(attempt_key(attempt, "acknowledged"), 0) < len(nodes) and time.monotonic() < deadline:
        time.sleep(0.05)


def await_decision(store: JobStore, spec: NodeSpec, attempt: int) -> dict:
    """A node's side: the head's decision on `attempt`; the head lost is the end of the job."""
    while True:
        try:
            decision = store.poll(attempt_key(attempt, "decision"), LOST_AFTER_S)
            if decision is not None:
                if decision["action"] != "restart":
                    store.add(attempt_key(attempt, "acknowledged"))
                return decision
            if node_alive(store, 0):
                continue
        except Exception:  # the head's store is gone with it
            pass
        return {"action": "stop", "code": 1, "restarts": 0,
                "line": f"shardwise: error: node 0 (the head, {spec.endpoint}) was lost: the job cannot go on without "
                        "it; rerun the job to resume from the newest checkpoint"}
