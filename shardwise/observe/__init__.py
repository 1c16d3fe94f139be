"""Observing a run: the communication log and per-rank state memory."""

from shardwise.observe.comm_log import CommLog
from shardwise.observe.memory import (
    format_bytes,
    format_memory_report,
    state_memory,
    tensor_bytes,
    unique_bytes,
    zero_formula_bytes,
)

__all__ = [
    "CommLog",
    "format_bytes",
    "format_memory_report",
    "state_memory",
    "tensor_bytes",
    "unique_bytes",
    "zero_formula_bytes",
]
