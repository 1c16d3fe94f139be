"""The nodes' handshake, before any rank starts: one rank per node, and every node running what the head runs.

Each node's launcher, once its own pre-launch checks passed (the same as on one machine: config, layout,
data, tokenizer, checkpoint shape), claims its node rank in the job store and posts its fingerprint: the
hash of its configuration, of the shardwise code it runs, and of the prepared data. A node whose
fingerprint differs from the head's is refused with one line naming the node and the field, and the head
stops with the same line: nobody has started a rank or touched the run directory. A second node claiming a
rank that a live node holds is refused; a node restarted after it was lost takes its rank back (the old
holder's presence stopped).

Presence: from its claim on, each node's launcher adds 1 to `alive/<node>.<incarnation>` every
PRESENCE_INTERVAL_S; that a launcher's counter stopped is how the others know it is gone (no clocks are
compared across machines). The incarnation tells a node's launcher started again from the one that was lost.
"""

from __future__ import annotations

import hashlib
import json
import socket
import threading
import time
from pathlib import Path

from shardwise.runtime.job_store import JobStore
from shardwise.runtime.nodes import NodeSpec

PRESENCE_INTERVAL_S = 0.5
VERDICT_WAIT_S = 10.0
"""How long a head that found a node unlike itself waits for that node to post its own refusal."""
FIELDS = {"config": "the configuration (config file and flags)", "code": "the shardwise code",
          "data": "the prepared data", "nproc": "--nproc"}


class NodeRefused(ValueError):
    """One line: why this node (or another) may not join the job (bad input: exit status 2)."""


def code_digest() -> str:
    """The shardwise source this process runs: every .py file of the package, by path and content."""
    root = Path(__file__).resolve().parents[1]
    hasher = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        hasher.update(str(path.relative_to(root)).encode())
        hasher.update(path.read_bytes())
    return hasher.hexdigest()[:16]


def fingerprint(config: dict, data_digest: str, nproc: int) -> dict:
    config_text = json.dumps(config, sort_keys=True, default=str)
    return {"host": socket.gethostname(), "config": hashlib.sha256(config_text.encode()).hexdigest()[:16],
            "code": code_digest(), "data": data_digest, "nproc": nproc}


class Presence:
    """This node's sign of life in the store, from its claim to its launcher's end (a daemon thread)."""

    def __init__(self, store: JobStore, node: int):
        self.store, self.key = store, f"alive/{node}.{store.incarnation}"
        self.done = threading.Event()
        self.thread = threading.Thread(target=self.run, name="shardwise-presence", daemon=True)

    def run(self) -> None:
        while not self.done.wait(PRESENCE_INTERVAL_S):
            try:
                self.store.add(self.key)
            except Exception:  # the head's store is gone: the job is over, or the head is lost
                return

    def start(self) -> Presence:
        self.store.add(self.key)
        self.thread.start()
        return self

    def stop(self) -> None:
        self.done.set()


def node_alive(store: JobStore, node: int, incarnation: str | None = None,
               wait_s: float = 4 * PRESENCE_INTERVAL_S) -> bool:
    """Whether the presence counter of `node`'s launcher `incarnation` (default: its rank's latest holder)
    moves within `wait_s`."""
    incarnation = incarnation or store.get(f"node/{node}", {}).get("incarnation")
    if incarnation is None:
        return False
    key = f"alive/{node}.{incarnation}"
    before = store.add(key, 0)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        time.sleep(PRESENCE_INTERVAL_S / 2)
        if store.add(key, 0) != before:
            return True
    return False


def claim_node_rank(store: JobStore, spec: NodeSpec, mine: dict) -> Presence:
    """Take this node's rank, refusing a second live holder; then show presence."""
    earlier = store.add(f"claim/{spec.node_rank}") > 1
    if earlier and store.poll(f"node/{spec.node_rank}", 4 * PRESENCE_INTERVAL_S) and node_alive(store, spec.node_rank):
        holder = store.get(f"node/{spec.node_rank}", {}).get("host", "another node")
        raise NodeRefused(f"--node-rank = {spec.node_rank} is invalid: {holder} already runs node {spec.node_rank} of "
                          "this job; give each node its own --node-rank")
    presence = Presence(store, spec.node_rank).start()
    store.set(f"node/{spec.node_rank}", {**mine, "incarnation": store.incarnation})
    return presence


def compare_with_head(store: JobStore, spec: NodeSpec, mine: dict) -> None:
    """A node's side: wait for the head's fingerprint and compare; a difference is posted and raised."""
    head = store.poll("node/0", spec.rdzv_timeout_s)
    if head is None:
        raise NodeRefused(f"node 0 (the head, {spec.endpoint}) posted nothing within {spec.rdzv_timeout_s:g} s "
                          "(--rdzv-timeout); start `shardwise train --node-rank 0` there")
    refuse_if_unlike_head(spec.node_rank, mine, head)


def refuse_if_unlike_head(node: int, theirs: dict, head: dict) -> None:
    """Refuse `node`, whose fingerprint is `theirs`, where it differs from the head's. Both sides check: the
    node to stop, the head so that it never launches beside a node that is being refused."""
    for field, what in FIELDS.items():
        if theirs[field] != head[field]:
            raise NodeRefused(f"node {node} ({theirs['host']}) is refused: its {field} ({what}) differs from the "
                              f"head's ({field} {theirs[field]} here, {head[field]} on node 0, {head['host']}); run "
                              "the same on every node")


def wait_for_nodes(store: JobStore, spec: NodeSpec, mine: dict) -> list[int]:
    """The head's side: wait until spec.min_nodes nodes posted fingerprints equal to `mine` (or one was refused)."""
    deadline = time.monotonic() + spec.rdzv_timeout_s
    while True:
        refused = store.get("refused")
        if refused:
            raise NodeRefused(f"{refused}")
        posted = {node: store.get(f"node/{node}") for node in range(spec.max_nodes)}
        present = [node for node, theirs in posted.items() if theirs is not None]
        for node in present:  # not only the node's own verdict: the head must not go on before it is posted
            try:
                refuse_if_unlike_head(node, posted[node], mine)
            except NodeRefused:
                # The node reads the head's fingerprint and refuses itself; the store (this process) stays up
                # until it has, or it would see the head gone (status 1) instead of its refusal (status 2).
                store.poll("refused", VERDICT_WAIT_S)
                raise
        if len(present) >= spec.min_nodes:
            return present
        if time.monotonic() >= deadline:
            missing = [str(node) for node in range(spec.max_nodes) if node not in present]
            raise NodeRefused(f"node{'s' if len(missing) > 1 else ''} {', '.join(missing)} did not join within "
                              f"{spec.rdzv_timeout_s:g} s (--rdzv-timeout): start `shardwise train --node-rank R` on "
                              f"each with --rdzv-endpoint {spec.endpoint}")
        time.sleep(0.1)


def join_job(store: JobStore, spec: NodeSpec, mine: dict) -> Presence:
    """The handshake: claim, post, compare (a node) or wait for the nodes (the head)."""
    presence = claim_node_rank(store, spec, mine)
    try:
        if spec.is_head:
            wait_for_nodes(store, spec, mine)
        else:
            compare_with_head(store, spec, mine)
    except BaseException as err:
        presence.stop()
        if isinstance(err, NodeRefused) and not spec.is_head:
            store.set("refused", str(err))  # the head stops with the same line
        raise
    return presence
