"""The flags of a job on several nodes, shared by `train` and `serve`, and the launch of one node of it.

Each node runs the same command with its own --node-rank; node 0 (the head) hosts the job's store at
--rdzv-endpoint. Before any rank starts, each node runs the one-machine checks, then the nodes' handshake
(runtime/node_check.py) refuses a node whose configuration, code or data differ from the head's; only then
does the head take the run directory (its lock, and with checkpoint.overwrite the old run moved aside).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable


def add_node_arguments(parser: argparse.ArgumentParser) -> None:
    from shardwise.cli.flag_types import finite_above

    group = parser.add_argument_group("several nodes (see docs/training.md: Several machines)")
    group.add_argument("--nnodes", default="1", metavar="N|MIN:MAX|auto",
                       help="machines in the job (default: 1): a count, MIN:MAX to shrink when a node is lost and "
                            "grow when one joins, or auto under Slurm")
    group.add_argument("--node-rank", default=None, metavar="R", help="this machine's rank, 0 on the head "
                       "(from SLURM_NODEID with --nnodes auto)")
    group.add_argument("--rdzv-endpoint", default=None, metavar="HOST[:PORT]",
                       help="the head's address and a free port, the same on every node (default port: 29500; "
                            "with --nnodes auto, the first node of SLURM_JOB_NODELIST)")
    group.add_argument("--rdzv-id", default=None, metavar="ID", help="names the job in the store (default: "
                       "SLURM_JOB_ID under Slurm, else shardwise)")
    group.add_argument("--rdzv-timeout", default=None, metavar="S",
                       type=finite_above(0, "use a positive number of seconds, at most 86400", at_most=86400),
                       help="seconds to wait for the other nodes before giving up (default: 600)")


def nodes_of(args: argparse.Namespace):
    """The job's NodeSpec from the flags (SINGLE_NODE for --nnodes 1)."""
    from shardwise.runtime.nodes import node_spec

    return node_spec(args.nnodes, args.node_rank, args.rdzv_endpoint, args.rdzv_timeout, args.rdzv_id)


def check_layout_on_every_node_count(nodes, nproc: int, check: Callable[[int], None]) -> None:
    """`check(world_size)` for each size the job may run at; its error names --nnodes."""
    given = str(nodes.max_nodes) if nodes.min_nodes == nodes.max_nodes else f"{nodes.min_nodes}:{nodes.max_nodes}"
    for count in nodes.node_counts():
        try:
            check(count * nproc)
        except ValueError as err:
            if not nodes.multi_node:
                raise
            raise ValueError(f"--nnodes = {given} is invalid with this layout: on {count} node{'s' if count > 1 else ''}"
                             f" x {nproc} processes, {err}") from None


def join_nodes(nodes, config: dict, data_digest: str, nproc: int):
    """Open the job's store and pass the handshake; (store, presence), or one line (ValueError) why not."""
    from shardwise.runtime.job_store import JobStore, StoreUnreachable
    from shardwise.runtime.node_check import fingerprint, join_job

    try:
        store = JobStore.open(nodes)
    except StoreUnreachable as err:
        raise ValueError(f"--rdzv-endpoint = {nodes.endpoint} is invalid here: {err} within {nodes.rdzv_timeout_s:g} s "
                         "(--rdzv-timeout); start node 0 first and check the host and port") from None
    return store, join_job(store, nodes, fingerprint(config, data_digest, nproc))  # NodeRefused: one line


def run_node(launch: Callable[[], int]) -> int:
    """This node's part of the job; the head gone (its store stopped answering) is one line and status 1."""
    from shardwise.runtime.job_store import StoreUnreachable

    try:
        return launch()
    except StoreUnreachable as err:
        print(f"shardwise: error: {err}: node 0 ended or was lost; if the job is still to run, start it again",
              file=sys.stderr, flush=True)
        return 1


def announce(nodes, nproc: int) -> None:
    if nodes.is_head:
        count = str(nodes.max_nodes) if nodes.min_nodes == nodes.max_nodes else f"{nodes.min_nodes} to {nodes.max_nodes}"
        print(f"shardwise: {count} nodes x {nproc} processes, rendezvous at {nodes.endpoint}", file=sys.stderr,
              flush=True)
