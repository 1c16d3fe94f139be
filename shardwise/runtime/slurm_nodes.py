"""Where a multi-node job's nodes come from under Slurm (`--nnodes auto`): the node count, this node's
rank and the head node (rank 0, the rendezvous host), read from the job's environment.

    SLURM_NNODES          the node count
    SLURM_NODEID          this node's index in the allocation, 0-based
    SLURM_JOB_NODELIST    the nodes in Slurm's compressed form, e.g. "node[01-04,07],gpu[1-2]-ib"

The node list is expanded as `scontrol show hostnames` expands it: each bracket holds comma-separated
numbers and ranges, a range keeps the zero-padding of its first number ("01-04": 01 02 03 04), several
bracket groups in one name give every combination, and commas outside brackets separate names. The
head node is the first name, as torchtitan's and PyTorch's Slurm examples take it (`scontrol show
hostnames | head -n 1`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

NODELIST_VARIABLES = ("SLURM_JOB_NODELIST", "SLURM_NODELIST")
"""Where Slurm puts the node list: the job's, or the step's in older versions."""


@dataclass(frozen=True)
class SlurmNodes:
    nnodes: int
    node_rank: int
    head: str
    """The first node of the list: the rendezvous endpoint's host."""


def slurm_nodes(environ: Mapping[str, str]) -> SlurmNodes:
    """`--nnodes auto`: the job's nodes from Slurm's environment, or one error naming what is missing."""
    nodelist_name = next((name for name in NODELIST_VARIABLES if environ.get(name)), None)
    missing = [name for name in ("SLURM_NNODES", "SLURM_NODEID") if not environ.get(name)]
    if nodelist_name is None or missing:
        absent = ", ".join([*missing, *([] if nodelist_name else ["SLURM_JOB_NODELIST"])])
        raise ValueError(f"--nnodes = auto is invalid here: it reads the nodes from Slurm's environment and {absent} "
                         "is not set; run it inside a Slurm job step (srun), or give --nnodes N --node-rank R "
                         "--rdzv-endpoint HOST:PORT")
    nodes = expand_nodelist(environ[nodelist_name], field=nodelist_name)
    nnodes = slurm_integer(environ, "SLURM_NNODES", least=1)
    node_rank = slurm_integer(environ, "SLURM_NODEID", least=0)
    if len(nodes) != nnodes:
        raise ValueError(f"SLURM_NNODES = {nnodes} is invalid: {nodelist_name} names {len(nodes)} nodes "
                         f"({environ[nodelist_name]}); run under one Slurm allocation, unaltered")
    if node_rank >= nnodes:
        raise ValueError(f"SLURM_NODEID = {node_rank} is invalid: the job has {nnodes} nodes (0 to {nnodes - 1})")
    return SlurmNodes(nnodes=nnodes, node_rank=node_rank, head=nodes[0])


def slurm_integer(environ: Mapping[str, str], name: str, *, least: int) -> int:
    text = environ[name].strip()
    if not text.isdigit() or int(text) < least:
        raise ValueError(f"{name} = {text!r} is invalid: Slurm sets a whole number of at least {least}; run under Slurm "
                         "unaltered, or give --nnodes N --node-rank R --rdzv-endpoint HOST:PORT")
    return int(text)


def expand_nodelist(text: str, *, field: str = "SLURM_JOB_NODELIST") -> list[str]:
    """Slurm's compressed node list as node names, in its order."""
    names = [name for item in split_outside_brackets(text, field) for name in expand_name(item, field)]
    if not names:
        raise ValueError(f"{field} = {text!r} is invalid: it names no node")
    return names


def split_outside_brackets(text: str, field: str) -> list[str]:
    """The comma-separated items of `text`, commas inside brackets left alone."""
    items, depth, start = [], 0, 0
    for index, char in enumerate(text):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if depth not in (0, 1):
            raise ValueError(f"{field} = {text!r} is invalid: its brackets do not pair up (Slurm does not nest them)")
        if char == "," and depth == 0:
            items.append(text[start:index])
            start = index + 1
    if depth:
        raise ValueError(f"{field} = {text!r} is invalid: a bracket is not closed")
    items.append(text[start:])
    return [item.strip() for item in items if item.strip()]


def expand_name(item: str, field: str) -> list[str]:
    """One name with bracket groups ("rack[1-2]-n[01-02]") as every name it stands for."""
    opening = item.find("[")
    if opening < 0:
        return [item]
    closing = item.index("]", opening)
    prefix, spec, rest = item[:opening], item[opening + 1:closing], item[closing + 1:]
    return [prefix + value + tail for value in range_values(spec, item, field) for tail in expand_name(rest, field)]


def range_values(spec: str, item: str, field: str) -> list[str]:
    """"01-04,07" as ["01", "02", "03", "04", "07"]: each range keeps its first number's width."""
    values = []
    for part in spec.split(","):
        first, _, last = part.strip().partition("-")
        if not first.isdigit() or (last and not last.isdigit()) or (last and int(last) < int(first)):
            raise ValueError(f"{field}: {item!r} has a bad range {part!r}; Slurm writes numbers and ranges "
                             "such as [01-04,07]")
        values += [str(number).zfill(len(first)) for number in range(int(first), int(last or first) + 1)]
    return values
