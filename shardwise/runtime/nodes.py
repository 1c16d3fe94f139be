"""Which nodes a job spans, from `--nnodes`, `--node-rank`, `--rdzv-endpoint` and `--rdzv-timeout` (or Slurm's
environment with `--nnodes auto`): the launcher's flags, checked here before anything starts.

    --nnodes 1               one machine, today's launch (the default)
    --nnodes N               N machines, each running `shardwise train --node-rank R` (R = 0 .. N-1)
    --nnodes MIN:MAX         elastic: the job runs on any MIN to MAX nodes; it shrinks when one is lost and
                             grows when one joins (train.rejoin_timeout_s)
    --nnodes auto            Slurm: N, this node's rank and the head node from SLURM_NNODES, SLURM_NODEID and
                             SLURM_JOB_NODELIST (runtime/slurm_nodes.py)

Node 0 is the head: it hosts the job's store (the rendezvous endpoint, runtime/job_store.py), and its
launcher judges stalls and decides restarts. The node rank is ours, for names in messages and for the
head; the ranks' own order is torch's elastic rendezvous's.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass

from shardwise.runtime.slurm_nodes import slurm_nodes

DEFAULT_PORT = 29500
"""torchrun's rendezvous port, and so the one Slurm scripts open."""
DEFAULT_RDZV_TIMEOUT_S = 600.0
"""How long a node waits for the others (torchrun's join timeout)."""


@dataclass(frozen=True)
class NodeSpec:
    min_nodes: int
    max_nodes: int
    node_rank: int
    host: str
    """The head node's address: the rendezvous endpoint's host."""
    port: int
    rdzv_timeout_s: float = DEFAULT_RDZV_TIMEOUT_S
    job_id: str = "shardwise"
    """Names the job's keys in the store (--rdzv-id; SLURM_JOB_ID under Slurm)."""

    @property
    def is_head(self) -> bool:
        return self.node_rank == 0

    @property
    def multi_node(self) -> bool:
        return self.max_nodes > 1

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def node_name(self) -> str:
        return node_name(self.node_rank)

    def node_counts(self) -> range:
        return range(self.min_nodes, self.max_nodes + 1)


def node_name(node_rank: int) -> str:
    """How messages and directories (RUN/collectives/<node>/) name a node: its rank and this machine's host."""
    return f"node{node_rank}-{socket.gethostname()}"


SINGLE_NODE = NodeSpec(min_nodes=1, max_nodes=1, node_rank=0, host="127.0.0.1", port=0)


def parse_nnodes(text: str) -> tuple[int, int]:
    """"N" or "MIN:MAX" as (min, max)."""
    low, sep, high = str(text).strip().partition(":")
    if not low.isdigit() or (sep and not high.isdigit()) or int(low) < 1 or (sep and int(high) < int(low)):
        raise ValueError(f"--nnodes = {text!r} is invalid: use a node count N, a range MIN:MAX (1 <= MIN <= MAX), "
                         "or auto (under Slurm)")
    return int(low), int(high if sep else low)


def parse_endpoint(text: str | None, *, default_host: str | None = None) -> tuple[str, int]:
    """"HOST[:PORT]" (port 29500 when left out)."""
    if not text:
        if default_host is None:
            raise ValueError("--rdzv-endpoint is missing: a job on several nodes needs HOST:PORT of node 0 "
                             "(the head), the same on every node")
        return default_host, DEFAULT_PORT
    host, sep, port = str(text).strip().rpartition(":")
    if not sep:
        host, port = str(text).strip(), str(DEFAULT_PORT)
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"--rdzv-endpoint = {text!r} is invalid: use HOST:PORT of node 0, e.g. node01:29500")
    return host, int(port)


def node_spec(nnodes: str, node_rank: str | int | None, endpoint: str | None, rdzv_timeout_s: float | None = None,
              rdzv_id: str | None = None, environ: Mapping[str, str] = os.environ) -> NodeSpec:
    """The job's nodes from the launcher's flags; SINGLE_NODE for `--nnodes 1` (today's launch)."""
    timeout = DEFAULT_RDZV_TIMEOUT_S if rdzv_timeout_s is None else rdzv_timeout_s
    if not isinstance(timeout, (int, float)) or not 0 < timeout <= 86400:  # NaN and inf too: a timedelta
        raise ValueError(f"--rdzv-timeout = {rdzv_timeout_s!r} is invalid: use a positive number of seconds, at "
                         "most 86400")
    if str(nnodes).strip() == "auto":
        slurm = slurm_nodes(environ)
        if node_rank not in (None, "", slurm.node_rank, str(slurm.node_rank)):
            raise ValueError(f"--node-rank = {node_rank} is invalid with --nnodes auto: Slurm gives this node rank "
                             f"{slurm.node_rank} (SLURM_NODEID); leave --node-rank out")
        low, high, rank = slurm.nnodes, slurm.nnodes, slurm.node_rank
        host, port = parse_endpoint(endpoint, default_host=slurm.head)
        job_id = rdzv_id or environ.get("SLURM_JOB_ID") or "shardwise"
    else:
        low, high = parse_nnodes(nnodes)
        if high == 1:
            if node_rank not in (None, "", 0, "0"):
                raise ValueError(f"--node-rank = {node_rank} is invalid: --nnodes is 1, whose only node is 0")
            return SINGLE_NODE
        rank = parse_node_rank(node_rank, high)
        host, port = parse_endpoint(endpoint)
        job_id = rdzv_id or "shardwise"
    return NodeSpec(min_nodes=low, max_nodes=high, node_rank=rank, host=host, port=port, rdzv_timeout_s=float(timeout),
                    job_id=job_id)


def parse_node_rank(value: str | int | None, max_nodes: int) -> int:
    text = str(value).strip() if value is not None else ""
    if not text:
        raise ValueError(f"--node-rank is missing: with --nnodes {max_nodes} each node needs its own rank, 0 on the "
                         f"head node, 1 to {max_nodes - 1} on the others")
    if not text.isdigit() or int(text) >= max_nodes:
        raise ValueError(f"--node-rank = {value} is invalid: the job's nodes are numbered 0 to {max_nodes - 1} "
                         f"(--nnodes); give each node its own")
    return int(text)
