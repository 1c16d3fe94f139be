"""Count the calls and bytes of ``torch.distributed`` collectives while a ``CommLog`` is active.

    with CommLog() as log:
        train_step()
    log.summary()   # {"all_gather_single": {"calls": 4, "bytes": ..., "bus_bytes": ...}, ...}

Conventions (S = the payload, n = ``dist.get_world_size(group)``):

    collective                        bytes (payload S)              bus_bytes (sent per rank, ring)
    all_reduce                        the tensor                     2(n-1)/n * S
    all_gather, all_gather_single,    the gathered OUTPUT (full)     (n-1)/n * S
      all_gather_into_tensor
    reduce_scatter, reduce_scatter_   the full INPUT                 (n-1)/n * S
      single, reduce_scatter_tensor
    all_to_all, all_to_all_single     the input                      (n-1)/n * S (exact for equal splits)
    broadcast                         the tensor                     (n-1)/n * S (average over ranks)
    send, isend                       the tensor                     S
    recv, irecv                       the tensor                     0

With these, ZeRO-3 (two all-gathers and one reduce-scatter of the parameters per step)
moves 3(n-1)/n * Psi bus bytes, 1.5x the 2(n-1)/n * Psi of data parallel's one all-reduce.

What FSDP2 calls (checked on torch 2.13, see tests/observe/test_comm_log.py):
``fully_shard`` all-gathers parameters with ``dist.all_gather_single`` (forward, and again
in backward when parameters were resharded after forward) and reduce-scatters gradients
with ``dist.reduce_scatter_single``; HSDP adds ``dist.all_reduce`` across replicas.
Older torch spells these ``all_gather_into_tensor`` / ``reduce_scatter_tensor``, which
torch 2.13 keeps as deprecated aliases; summary keys are the name that was called, and
``summary(by="kind")`` merges the spellings into one entry per kind.

How the counting works, and where it cannot see:
- The functions are replaced by counting wrappers as attributes of the ``torch.distributed``
  module while at least one log is active, and restored when the last one exits. Callers
  that look the function up on the module at call time (``dist.all_reduce(...)``, as FSDP2,
  ``torch.distributed.pipelining`` and our own code do) are counted. A reference bound
  earlier by ``from torch.distributed import all_reduce`` still points at the original
  and is NOT counted: call collectives through the module.
- ``isend``/``irecv`` are also replaced in ``torch.distributed.distributed_c10d``, because
  ``P2POp`` checks its ``op`` against that module's globals; replacing them on only one
  module would make ``P2POp(dist.isend, ...)`` raise inside the log. ``batch_isend_irecv``
  counts each op of its list as its ``isend``/``irecv``.
- The other deprecated aliases are left alone in ``distributed_c10d`` on purpose: their
  bodies call ``all_gather_single``/``reduce_scatter_single`` through those globals, and
  ``_coalescing_manager`` compares queued ops against them by identity.
- A call made while another counted call is running on the same thread (an alias calling
  its replacement, ``batch_isend_irecv`` calling ``isend``, ``__torch_function__``
  re-dispatch) is not counted again.
- Calls are counted when issued, so ``async_op=True`` calls count before their ``Work``
  completes; a call that raises is not counted; a rank outside ``group`` counts nothing.
- Not seen: collectives issued from C++ (DDP's bucketed gradient all-reduce),
  functional collectives (``torch.distributed._functional_collectives``, which DTensor
  redistribution — tensor parallel — uses), and compiled graphs. ``torch.distributed.
  tensor.debug.CommDebugMode`` counts calls (not bytes) of those.
"""

import functools
import inspect
import threading
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Literal

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d


@dataclass(frozen=True)
class _Collective:
    kind: str
    payload_arg: str  # the argument whose size is the payload S
    bus_factor: Callable[[int], float]  # n -> bus_bytes / S


def _ring_all_reduce(n: int) -> float:
    return 2 * (n - 1) / n


def _ring_share(n: int) -> float:
    return (n - 1) / n


_SPECS: dict[str, _Collective] = {
    "all_reduce": _Collective("all_reduce", "tensor", _ring_all_reduce),
    "all_gather": _Collective("all_gather", "tensor_list", _ring_share),
    "all_gather_single": _Collective("all_gather", "output_tensor", _ring_share),
    "all_gather_into_tensor": _Collective("all_gather", "output_tensor", _ring_share),
    "_all_gather_base": _Collective("all_gather", "output_tensor", _ring_share),
    "reduce_scatter": _Collective("reduce_scatter", "input_list", _ring_share),
    "reduce_scatter_single": _Collective("reduce_scatter", "input", _ring_share),
    "reduce_scatter_tensor": _Collective("reduce_scatter", "input", _ring_share),
    "_reduce_scatter_base": _Collective("reduce_scatter", "input", _ring_share),
    "broadcast": _Collective("broadcast", "tensor", _ring_share),
    "all_to_all_single": _Collective("all_to_all", "input", _ring_share),
    "all_to_all": _Collective("all_to_all", "input_tensor_list", _ring_share),
    "send": _Collective("send", "tensor", lambda n: 1.0),
    "isend": _Collective("send", "tensor", lambda n: 1.0),
    "recv": _Collective("recv", "tensor", lambda n: 0.0),
    "irecv": _Collective("recv", "tensor", lambda n: 0.0),
}

# P2POp validates its op against distributed_c10d's own isend/irecv (see the docstring).
_ALSO_PATCHED_IN_C10D = ("isend", "irecv")

# Module state because patching torch.distributed is process-wide anyway: one set of wrappers,
# installed while any log is active, feeding every active log. Nothing remains after the last exit.
_lock = threading.Lock()
_active_logs: list["CommLog"] = []
_originals: dict[tuple[ModuleType, str], Callable] = {}
_wrapper_by_original: dict[Callable, Callable] = {}
_thread_state = threading.local()


class CommLog:
    """Counts calls and bytes of torch.distributed collectives while active."""

    def __init__(self) -> None:
        self._counts: dict[str, dict[str, float]] = {}
        self._kind_of: dict[str, str] = {}

    def __enter__(self) -> "CommLog":
        with _lock:
            if self in _active_logs:
                raise RuntimeError("this CommLog is already active; use a second CommLog to nest")
            if not _active_logs:
                _install_wrappers()
            _active_logs.append(self)
        return self

    def __exit__(self, *exc_info) -> None:
        with _lock:
            _active_logs.remove(self)
            if not _active_logs:
                _restore_originals()

    def reset(self) -> None:
        with _lock:
            self._counts.clear()
            self._kind_of.clear()

    def summary(self, by: Literal["op", "kind"] = "op") -> dict[str, dict[str, float]]:
        """Per function called (``by="op"``) or per collective kind (``by="kind"``):
        ``{"calls": n, "bytes": payload, "bus_bytes": b}``."""
        with _lock:
            if by == "op":
                return {op: dict(counts) for op, counts in self._counts.items()}
            if by != "kind":
                raise ValueError(f"summary(by={by!r}): expected 'op' or 'kind'")
            merged: dict[str, dict[str, float]] = {}
            for op, counts in self._counts.items():
                entry = merged.setdefault(self._kind_of[op], {"calls": 0, "bytes": 0, "bus_bytes": 0.0})
                for key, value in counts.items():
                    entry[key] += value
            return merged

    def total(self, key: str = "bus_bytes") -> float:
        return sum(counts[key] for counts in self.summary().values())

    def _add(self, op: str, kind: str, payload_bytes: int, bus_bytes: float) -> None:
        counts = self._counts.setdefault(op, {"calls": 0, "bytes": 0, "bus_bytes": 0.0})
        counts["calls"] += 1
        counts["bytes"] += payload_bytes
        counts["bus_bytes"] += bus_bytes
        self._kind_of[op] = kind


def _payload_bytes(value: torch.Tensor | list[torch.Tensor]) -> int:
    tensors = value if isinstance(value, (list, tuple)) else [value]
    return sum(t.numel() * t.element_size() for t in tensors)


def _record(
    op: str, kind: str, payload_bytes: int, group_size: int, bus_factor: Callable[[int], float]
) -> None:
    if group_size < 1:  # dist.get_world_size returns -1 on a rank outside the group
        return
    bus_bytes = payload_bytes * bus_factor(group_size)
    with _lock:
        for log in _active_logs:
            log._add(op, kind, payload_bytes, bus_bytes)


def _record_call(op: str, spec: _Collective, call: inspect.BoundArguments) -> None:
    arguments = call.arguments
    group_size = dist.get_world_size(arguments.get("group"))
    _record(op, spec.kind, _payload_bytes(arguments[spec.payload_arg]), group_size, spec.bus_factor)


def _record_batch_p2p(p2p_ops: list) -> None:
    for p2p_op in p2p_ops:
        op = p2p_op.op.__name__  # "isend" or "irecv"; the wrappers keep the name
        spec = _SPECS[op]
        group_size = dist.get_world_size(p2p_op.group)
        _record(op, spec.kind, _payload_bytes(p2p_op.tensor), group_size, spec.bus_factor)


@functools.cache
def _signature(function: Callable) -> inspect.Signature:
    return inspect.signature(function)


def _counting_wrapper(op: str, original: Callable) -> Callable:
    """One wrapper per original function, so P2POps built in one log still match in the next."""
    if original in _wrapper_by_original:
        return _wrapper_by_original[original]
    if original in _wrapper_by_original.values():  # left installed by an interrupted exit
        return original

    @functools.wraps(original)
    def counting(*args, **kwargs):
        if not _active_logs or getattr(_thread_state, "depth", 0):
            return original(*args, **kwargs)
        _thread_state.depth = 1
        try:
            result = original(*args, **kwargs)
        finally:
            _thread_state.depth = 0
        if op == "batch_isend_irecv":
            _record_batch_p2p(_signature(original).bind(*args, **kwargs).arguments["p2p_op_list"])
        else:
            call = _signature(original).bind(*args, **kwargs)
            call.apply_defaults()
            _record_call(op, _SPECS[op], call)
        return result

    _wrapper_by_original[original] = counting
    return counting


def _patch_targets() -> list[tuple[ModuleType, str]]:
    names = [*_SPECS, "batch_isend_irecv"]
    targets = [(dist, name) for name in names if hasattr(dist, name)]  # torch >= 2.11 lacks some
    return targets + [(c10d, name) for name in _ALSO_PATCHED_IN_C10D]


def _install_wrappers() -> None:
    for module, name in _patch_targets():
        original = getattr(module, name)
        _originals[(module, name)] = original
        setattr(module, name, _counting_wrapper(name, original))


def _restore_originals() -> None:
    for (module, name), original in _originals.items():
        setattr(module, name, original)
    _originals.clear()
