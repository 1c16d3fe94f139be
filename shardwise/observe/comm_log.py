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
    reduce, gather, scatter           the tensor (gather: input,     (n-1)/n * S (average over ranks)
                                        scatter: output)
    send, isend                       the tensor                     S
    recv, irecv                       the tensor                     0
    barrier, all_gather_object,       0 (objects are pickled         0: counted as calls
      gather_object, broadcast_         inside, their size unseen)
      object_list, scatter_object_list

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
- The functions are replaced by wrappers as attributes of the ``torch.distributed`` module
  while at least one log is active, and restored when none is left. A log may carry a tracer
  (``CommLog(tracer=...)``: the flight recorder, observe/flight_recorder.py, which keeps each
  rank's last collectives for a hang or a failure to be read after the fact; the run context
  keeps one such log active for the whole run). One wrapper serves all: it describes the call
  once (``CollectiveCall``), tells each active log's tracer (each tracer once) before and after
  it runs (also when it raises), and adds it to every active log. Callers
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
- Not seen: collectives issued from C++ (DDP's bucketed gradient all-reduce), and
  collectives inside compiled graphs (see below).

Functional collectives (DTensor, tensor parallel):
DTensor redistribution — ``parallelize_module`` with Colwise/Rowwise/SequenceParallel,
``loss_parallel``, and their backward, which autograd runs through the same code — calls
``torch.distributed._functional_collectives``, whose C++ ops ``torch.ops._c10d_functional.*``
reach the ProcessGroup without passing through the ``torch.distributed`` functions above.
So each log also enters a ``TorchDispatchMode`` (as ``torch.distributed.tensor.debug.
CommDebugMode`` does, which counts calls, not bytes) that counts those ops under their op
name, e.g. ``"_c10d_functional.all_gather_into_tensor"``, with the conventions of the table
(n = the op's ``group_size``, or the size of the group its ``group_name`` names);
``summary(by="kind")`` merges them into the same kinds as the ``dist.*`` calls.
``_dtensor.shard_dim_alltoall`` (DTensor's Shard(i) -> Shard(j) on accelerators) does its
all-to-all inside C++, so it is counted itself; on CPU DTensor all-gathers instead.
- Nothing is counted twice (checked on torch 2.13, see the tests): ``dist.*`` functions
  dispatch the ``c10d.*`` ops (``c10d.allreduce_``), which the mode ignores; functional
  ops are C++ kernels that do not call ``dist.*``; the autograd variants
  (``_c10d_functional_autograd.*``) reach the mode only as the plain op they wrap; and a
  functional op issued while a counted ``dist.*`` call runs on the thread is skipped.
- The mode is thread-local: functional collectives are counted on the thread that entered
  the log and in the backward passes it runs (autograd carries the thread's modes into
  backward), while ``dist.*`` calls are counted from any thread.
- DTensor is let through the mode first (``NotImplemented``), so the mode sees the plain
  ops it desugars into; other subclasses and higher-order operators run below the mode,
  so a collective issued inside one of those is not seen.
- Tracers are told of functional collectives only while a log's mode is active, by the
  outermost mode of the thread (so nested logs do not tell them twice), and see them as issued:
  their completion (``wait_tensor``) is not followed.
- The mode declares ``ignore_compile_internals``: otherwise any active mode makes
  ``torch.compile`` fall back to eager, and the trainer runs every step inside a log. So
  collectives inside a compiled graph are not promised to be counted.
- Cost: while a log is active every eager op passes through the mode's Python
  ``__torch_dispatch__``, about 10-20 us per op (on a 2-core CPU a tiny 8-layer MLP step
  went from 1.6 to 4.1 ms, a 1024-wide one from 31 to 36 ms). ``CommLog(functional_
  collectives=False)`` counts ``dist.*`` calls only, without that cost.
"""

import functools
import inspect
import threading
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Literal, Protocol

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode


@dataclass(frozen=True)
class _Collective:
    kind: str
    payload_arg: str | None  # the argument whose size is the payload S; None: no tensor payload
    bus_factor: Callable[[int], float]  # n -> bus_bytes / S


def _ring_all_reduce(n: int) -> float:
    return 2 * (n - 1) / n


def _ring_share(n: int) -> float:
    return (n - 1) / n


def _all_of_it(n: int) -> float:
    return 1.0


def _none_of_it(n: int) -> float:
    return 0.0


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
    "reduce": _Collective("reduce", "tensor", _ring_share),
    "gather": _Collective("gather", "tensor", _ring_share),
    "scatter": _Collective("scatter", "tensor", _ring_share),
    "all_to_all_single": _Collective("all_to_all", "input", _ring_share),
    "all_to_all": _Collective("all_to_all", "input_tensor_list", _ring_share),
    "send": _Collective("send", "tensor", _all_of_it),
    "isend": _Collective("send", "tensor", _all_of_it),
    "recv": _Collective("recv", "tensor", _none_of_it),
    "irecv": _Collective("recv", "tensor", _none_of_it),
    # No tensor payload: counted as calls, and kept by the flight recorder (checkpoint saves use them).
    "barrier": _Collective("barrier", None, _none_of_it),
    "all_gather_object": _Collective("all_gather_object", None, _none_of_it),
    "gather_object": _Collective("gather_object", None, _none_of_it),
    "broadcast_object_list": _Collective("broadcast_object_list", None, _none_of_it),
    "scatter_object_list": _Collective("scatter_object_list", None, _none_of_it),
}

# P2POp validates its op against distributed_c10d's own isend/irecv (see the docstring).
_ALSO_PATCHED_IN_C10D = ("isend", "irecv")


@dataclass(slots=True)  # not frozen: a frozen dataclass's __init__ costs 2 us, on every collective
class CollectiveCall:
    """One collective as a wrapper sees it just before it runs: what a log counts and a tracer keeps."""

    op: str  # the name called: "all_gather_single", "_c10d_functional.all_reduce"
    kind: str  # the same collective under one name: "all_gather"
    tensors: tuple[torch.Tensor, ...]  # the payload
    payload_bytes: int
    bus_bytes: float
    group: dist.ProcessGroup
    async_op: bool  # returns before the collective is done (a Work, or a functional collective's tensor)


class CollectiveTracer(Protocol):
    """Told of every collective the wrappers see, in any thread, while a log that carries it is active
    (the flight recorder, observe/flight_recorder.py)."""

    def issued(self, call: CollectiveCall) -> object:
        """Before the call runs; returns a handle for the two below."""

    def returned(self, handle: object, work: dist.Work | None) -> None:
        """The call returned: with its Work for an async_op call (None for a blocking one, which is done)."""

    def raised(self, handle: object, error: BaseException) -> None:
        """The call raised `error` (re-raised after this)."""


# Module state because patching torch.distributed is process-wide anyway: one set of wrappers,
# installed while any log is active, feeding the active logs and their tracers. Nothing of a run
# (rank, directory, recorder) lives here, and nothing remains after the last log exits.
_lock = threading.Lock()
_active_logs: list["CommLog"] = []
_originals: dict[tuple[ModuleType, str], Callable] = {}
_wrapper_by_original: dict[Callable, Callable] = {}
_thread_state = threading.local()  # depth: inside a wrapped call; tracing_mode: the mode that feeds the tracers


class CommLog:
    """Counts calls and bytes of torch.distributed collectives while active.

    ``functional_collectives=False`` skips the dispatch mode that counts functional
    collectives (DTensor, tensor parallel), and with it its cost on every eager op.
    ``tracer``: told of every collective issued while this log is active (see the module docstring).
    """

    def __init__(self, *, functional_collectives: bool = True, tracer: CollectiveTracer | None = None) -> None:
        self._counts: dict[str, dict[str, float]] = {}
        self._kind_of: dict[str, str] = {}
        self._count_functional = functional_collectives
        self._functional_mode: _FunctionalCollectiveMode | None = None
        self.tracer = tracer

    def __enter__(self) -> "CommLog":
        with _lock:
            if self in _active_logs:
                raise RuntimeError("this CommLog is already active; use a second CommLog to nest")
            if not _active_logs:
                _install_wrappers()
            _active_logs.append(self)
        if self._count_functional:
            # One mode per log, so nested logs each see every functional op once (an outer
            # mode sees the op when the inner one runs it).
            self._functional_mode = _FunctionalCollectiveMode(self)
            self._functional_mode.__enter__()
            if getattr(_thread_state, "tracing_mode", None) is None:
                # The outermost mode feeds the tracers: the op runs inside it, once, whatever is nested.
                _thread_state.tracing_mode = self._functional_mode
        return self

    def __exit__(self, *exc_info) -> None:
        if self._functional_mode is not None:
            if getattr(_thread_state, "tracing_mode", None) is self._functional_mode:
                _thread_state.tracing_mode = None
            self._functional_mode.__exit__(*exc_info)
            self._functional_mode = None
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

    def _add(self, call: CollectiveCall) -> None:  # the caller holds _lock
        counts = self._counts.setdefault(call.op, {"calls": 0, "bytes": 0, "bus_bytes": 0.0})
        counts["calls"] += 1
        counts["bytes"] += call.payload_bytes
        counts["bus_bytes"] += call.bus_bytes
        self._kind_of[call.op] = call.kind


def _active_tracers() -> tuple[CollectiveTracer, ...]:
    """The active logs' tracers, each once (a recorder carried by two nested logs records a call once)."""
    return tuple(dict.fromkeys(log.tracer for log in list(_active_logs) if log.tracer is not None))


def _payload_tensors(value) -> tuple[torch.Tensor, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, (list, tuple)) else (value,)


def _describe(op: str, spec: "_Collective | _FunctionalCollective", payload, group: dist.ProcessGroup | None,
              async_op: bool, group_size: int | None = None) -> list[CollectiveCall]:
    """The call as counted and traced; none on a rank outside `group` (the call does nothing there)."""
    group = group or c10d._get_default_group()
    if group_size is None:
        group_size = dist.get_world_size(group)  # -1 on a rank outside the group
    if group_size < 1:
        return []
    tensors = _payload_tensors(payload)
    payload_bytes = sum(t.numel() * t.element_size() for t in tensors)
    if getattr(spec, "payload_is_gathered_output", False):
        payload_bytes *= group_size
    return [CollectiveCall(op, spec.kind, tensors, payload_bytes, payload_bytes * spec.bus_factor(group_size),
                           group, async_op)]


def _describe_dist_call(op: str, original: Callable, args: tuple, kwargs: dict) -> list[CollectiveCall]:
    if op == "batch_isend_irecv":  # each op of its list as its isend or irecv
        return [described for p2p_op in _argument(original, args, kwargs, "p2p_op_list")
                for described in _describe(p2p_op.op.__name__, _SPECS[p2p_op.op.__name__], p2p_op.tensor,
                                           p2p_op.group, async_op=True)]
    spec = _SPECS[op]
    payload = _argument(original, args, kwargs, spec.payload_arg) if spec.payload_arg else None
    return _describe(op, spec, payload, _argument(original, args, kwargs, "group"),
                     bool(_argument(original, args, kwargs, "async_op")))


def _argument(function: Callable, args: tuple, kwargs: dict, name: str):
    """The value of parameter `name` in a call of `function`, its default if not given (None if it has
    no such parameter). Cheaper than binding the signature (7 us), paid on every collective while the
    flight recorder is installed; the wrapped functions take no *args and no keyword-only parameters."""
    if name in kwargs:
        return kwargs[name]
    position, default = _parameters(function).get(name, (len(args), None))
    if position < len(args):
        return args[position]
    if default is inspect.Parameter.empty:
        raise TypeError(f"{function.__name__}() missing argument {name!r}")  # the call itself says so
    return default


@functools.cache
def _parameters(function: Callable) -> dict[str, tuple[int, object]]:
    return {name: (position, parameter.default)
            for position, (name, parameter) in enumerate(inspect.signature(function).parameters.items())}


def _run_observed(calls: list[CollectiveCall], run: Callable, tracers: tuple[CollectiveTracer, ...]):
    """`run()`, with each of `tracers` told before and after each of `calls`."""
    handles = [[tracer.issued(call) for call in calls] for tracer in tracers]
    try:
        result = run()
    except BaseException as error:
        for tracer, its_handles in zip(tracers, handles):
            for handle in its_handles:
                tracer.raised(handle, error)
        raise
    if tracers:
        # batch_isend_irecv returns one Work per op; other calls a Work (async_op), a tensor or None.
        works = result if isinstance(result, list) and len(result) == len(calls) else [result] * len(calls)
        for tracer, its_handles in zip(tracers, handles):
            for handle, work in zip(its_handles, works):
                tracer.returned(handle, work if isinstance(work, dist.Work) else None)
    return result


def _observing_wrapper(op: str, original: Callable) -> Callable:
    """One wrapper per original function, so P2POps built in one log still match in the next."""
    if original in _wrapper_by_original:
        return _wrapper_by_original[original]
    if original in _wrapper_by_original.values():  # left installed by an interrupted exit
        return original

    @functools.wraps(original)
    def observing(*args, **kwargs):
        if getattr(_thread_state, "depth", 0) or not _active_logs:
            return original(*args, **kwargs)
        return _observed_call(op, original, args, kwargs)

    _wrapper_by_original[original] = observing
    return observing


# Eager under torch.compile (a block that calls a collective, as context parallelism's all-to-all
# does): traced, the bookkeeping broke the graph midway and its guards on the flight recorder's step
# recompiled a frame at every step; disabled, the graph breaks once, here, and the call is recorded.
@torch.compiler.disable
def _observed_call(op: str, original: Callable, args: tuple, kwargs: dict):
    try:
        calls = _describe_dist_call(op, original, args, kwargs)
    except Exception:  # arguments the call itself rejects: let it say why, unobserved
        return original(*args, **kwargs)
    _thread_state.depth = 1
    try:
        result = _run_observed(calls, lambda: original(*args, **kwargs), _active_tracers())
    finally:
        _thread_state.depth = 0
    with _lock:
        for log in _active_logs:
            for call in calls:
                log._add(call)
    return result


def _patch_targets() -> list[tuple[ModuleType, str]]:
    names = [*_SPECS, "batch_isend_irecv"]
    targets = [(dist, name) for name in names if hasattr(dist, name)]  # torch >= 2.11 lacks some
    return targets + [(c10d, name) for name in _ALSO_PATCHED_IN_C10D]


def _install_wrappers() -> None:
    for module, name in _patch_targets():
        original = getattr(module, name)
        _originals[(module, name)] = original
        setattr(module, name, _observing_wrapper(name, original))


def _restore_originals() -> None:
    for (module, name), original in _originals.items():
        setattr(module, name, original)
    _originals.clear()


# --- Functional collectives (torch.ops._c10d_functional), counted by a dispatch mode ---


@dataclass(frozen=True)
class _FunctionalCollective:
    kind: str
    bus_factor: Callable[[int], float]
    payload_is_gathered_output: bool = False  # the output is n times the input


# Keyed "namespace.op", the name summaries show.
_FUNCTIONAL_SPECS: dict[str, _FunctionalCollective] = {
    "_c10d_functional.all_reduce": _FunctionalCollective("all_reduce", _ring_all_reduce),
    "_c10d_functional.all_reduce_": _FunctionalCollective("all_reduce", _ring_all_reduce),
    "_c10d_functional.all_reduce_coalesced": _FunctionalCollective("all_reduce", _ring_all_reduce),
    "_c10d_functional.all_reduce_coalesced_": _FunctionalCollective("all_reduce", _ring_all_reduce),
    "_c10d_functional.all_gather_into_tensor": _FunctionalCollective("all_gather", _ring_share, True),
    "_c10d_functional.all_gather_into_tensor_out": _FunctionalCollective("all_gather", _ring_share, True),
    "_c10d_functional.all_gather_into_tensor_coalesced": _FunctionalCollective("all_gather", _ring_share, True),
    "_c10d_functional.reduce_scatter_tensor": _FunctionalCollective("reduce_scatter", _ring_share),
    "_c10d_functional.reduce_scatter_tensor_out": _FunctionalCollective("reduce_scatter", _ring_share),
    "_c10d_functional.reduce_scatter_tensor_coalesced": _FunctionalCollective("reduce_scatter", _ring_share),
    "_c10d_functional.all_to_all_single": _FunctionalCollective("all_to_all", _ring_share),
    "_dtensor.shard_dim_alltoall": _FunctionalCollective("all_to_all", _ring_share),
    "_c10d_functional.broadcast": _FunctionalCollective("broadcast", _ring_share),
    "_c10d_functional.broadcast_": _FunctionalCollective("broadcast", _ring_share),
    "_c10d_functional.isend": _FunctionalCollective("send", _all_of_it),
    "_c10d_functional.irecv": _FunctionalCollective("recv", _none_of_it),
}
_BATCH_P2P = "_c10d_functional.batch_p2p_ops"  # counted per queued op, as its isend or irecv


@functools.cache
def _functional_spec_by_packet() -> dict:
    """OpOverloadPacket -> (op name, spec): a dict lookup per dispatched op keeps the mode cheap."""
    specs = {}
    for op, spec in [*_FUNCTIONAL_SPECS.items(), (_BATCH_P2P, None)]:
        namespace, name = op.split(".")
        if hasattr(getattr(torch.ops, namespace), name):  # the set of ops differs between torch versions
            specs[getattr(getattr(torch.ops, namespace), name)] = (op, spec)
    return specs


def _functional_group(arguments: dict) -> dist.ProcessGroup:
    group = arguments["group_name"]  # a name, or in newer schemas possibly the group itself
    return group if isinstance(group, dist.ProcessGroup) else c10d._resolve_process_group(group)


def _describe_functional(op: str, spec: _FunctionalCollective | None, arguments: dict) -> list[CollectiveCall]:
    group = _functional_group(arguments)
    group_size = arguments.get("group_size", group.size())
    if spec is None:  # batch_p2p_ops: each queued op counts as its isend/irecv, as batch_isend_irecv does
        return [described for p2p_name, tensor in zip(arguments["op_list"], arguments["tensors"])
                for described in _describe(f"_c10d_functional.{p2p_name}",
                                           _FUNCTIONAL_SPECS[f"_c10d_functional.{p2p_name}"], tensor, group,
                                           async_op=True, group_size=group_size)]
    payload = arguments.get("input", arguments.get("inputs", arguments.get("tensor")))
    return _describe(op, spec, payload, group, async_op=True, group_size=group_size)


class _FunctionalCollectiveMode(TorchDispatchMode):
    """Counts the ops of ``_FUNCTIONAL_SPECS`` into one log (the outermost mode also tells the
    tracers); every op runs unchanged."""

    # Else a higher-order op (DTensor's random ops on accelerators, flex_attention) raises under the mode.
    supports_higher_order_operators = True

    def __init__(self, log: CommLog) -> None:
        super().__init__()
        self.log = log

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True  # keep torch.compile compiling while a log is active (see the module docstring)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **kwargs)
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # DTensor desugars first; its collectives come back here as plain ops
        found = _functional_spec_by_packet().get(func._overloadpacket)
        if found is None or getattr(_thread_state, "depth", 0):
            return func(*args, **kwargs)
        names = [argument.name for argument in func._schema.arguments]
        calls = _describe_functional(*found, {**dict(zip(names, args)), **kwargs})
        tracers = _active_tracers() if getattr(_thread_state, "tracing_mode", None) is self else ()
        out = _run_observed(calls, lambda: func(*args, **kwargs), tracers)
        with _lock:
            for call in calls:
                self.log._add(call)
        return out
