"""Each rank's last collectives, kept in memory and written out when a job stalls or a collective fails.

    recorder = FlightRecorder(rank, run_dir)
    with recording(recorder, heartbeat):   # around the whole run (the run context, train/context.py)
        ...
        recorder.step = step              # as each training step starts
    recorder.dump("why")                  # RUN/collectives/rank<R>.json, on demand

What NCCL's flight recorder (torch's TORCH_FR_BUFFER_SIZE) does for NCCL, for every backend,
gloo on CPU included: a ring buffer of the last `capacity` collectives this process issued
(default 128), each with its sequence number (per process group, as NCCL numbers them, and one
over the whole process), op, payload shapes/dtypes/bytes, group (name, description such as a
mesh axis, member ranks), the training step it belongs to, when it started and whether it
finished. After a hang, the ranks' last records side by side say which rank is behind and which
collective the others wait in.

Where it is fed from: observe/comm_log.py's wrappers, as the tracer of a log that `recording` keeps
active, so recording is always on inside it, not only inside a training step's CommLog: saves,
evaluation and barriers count too, and a call is recorded once however many logs are active. Functional
collectives (DTensor, tensor parallel) are recorded while a CommLog counts them (its dispatch
mode), and only as issued. Not seen: what comm_log cannot see (collectives from C++, inside
compiled graphs).

States: "issued" (running, or an async call whose Work has not completed: a hung rank's last
record), "completed" (a blocking call returned; an async call's Work completed), "failed"
(the call raised), "released" (an async call whose Work has no future, gloo's point-to-point,
and which the caller let go of before it was seen completed: normally after waiting on it).
Such a Work's "completed" is seen when the records are written, and has no end_time. On
accelerators a blocking call returns once queued on its stream, so "completed" means queued
there; NCCL's own recorder knows the device side (the launcher turns it on for CUDA,
runtime/launch.py).

When it is written:
- A collective raises in this rank (gloo's "Connection closed by peer" after a peer died, a
  timeout), or an async one's Work fails (DDP's gradient all-reduce): `RUN/collectives/rank<R>.json`
  at once, before the error goes on, with the error as the reason and that record "failed". Not
  for a Work without a future (gloo's point-to-point): its error is raised by `wait`, unseen here.
- Under `shardwise train --nproc N` with train.stall_timeout_s > 0: each beat of the rank's
  heartbeat thread (runtime/heartbeat.py, which keeps beating while the main thread waits
  in a collective), and each `Heartbeat.progress` (a step, a save), writes the records beside
  the heartbeat when they changed; when the launcher stops a stalled job or a rank fails, it
  copies every rank's newest into `RUN/collectives/` and writes `summary.txt` there. A frozen
  or killed rank's file is from its last beat or progress: the collectives after it (the few
  between a step's end and the freeze) are missing, and the summary says so.
- `dump(reason)`, for any other path that wants it.

The file (JSON): {"rank", "pid", "host", "reason", "time" (written), "source" ("dump" or
"heartbeat"), "step" (current), "capacity", "recorded" (collectives so far, all groups),
"groups": [{"name", "desc", "ranks", "seq", "p2p_seq"}] (each group's last numbers), "records":
oldest first, each {"global_seq", "seq" (per group; null for point-to-point), "p2p_seq"
(per group, point-to-point only), "op", "kind", "group", "group_desc", "group_ranks",
"shapes", "dtypes", "bytes", "step", "async_op", "state", "start_time", "end_time", "error"}}.
Times are Unix seconds.

Cost: about 15 us of Python a collective (describing the call, which a CommLog does anyway, and
a record appended under a lock; measured on a 2-core CPU: a one-rank gloo all-reduce of one
float 35 -> 68 us, 52 -> 71 us when a CommLog is active too), nothing on the device; an async
call adds a callback on its Work's future. Writing a full ring to JSON takes about 1-2 ms, off
the main thread except at `Heartbeat.progress`.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Iterator
from pathlib import Path

import torch.distributed as dist

from shardwise.runtime import collective_files
from shardwise.runtime.heartbeat import Heartbeat
from shardwise.runtime.launch import RECORDER_CAPACITY_ENV
from shardwise.observe.comm_log import CollectiveCall, CommLog

DEFAULT_CAPACITY = 128
POINT_TO_POINT = ("send", "recv")  # numbered apart (p2p_seq), as NCCL does: a pair's counts need not match the group's
_ERROR_CHARS = 300
FINAL_STATES = ("completed", "failed", "released")


class CollectiveRecord:
    """One collective of the ring buffer; mutable, because it finishes after it is recorded."""

    FIELDS = ("global_seq", "seq", "p2p_seq", "op", "kind", "group", "group_desc", "group_ranks", "shapes", "dtypes",
              "bytes", "step", "async_op", "state", "start_time", "end_time", "error")
    __slots__ = (*FIELDS, "work", "text")
    # work: a weak reference to an async call's Work that has no future (gloo's point-to-point), looked
    # at when the records are written; weak, so the ring never keeps a Work's buffers alive.
    # text: the record as JSON, kept once it is final (see `as_json`).

    def as_dict(self) -> dict:
        body = {name: getattr(self, name) for name in self.FIELDS}
        # Kept as torch.Size and torch.dtype while recording (cheap); made JSON when written.
        body["shapes"] = [list(shape) for shape in self.shapes]
        body["dtypes"] = [str(dtype).removeprefix("torch.") for dtype in self.dtypes]
        return body

    def as_json(self) -> str:
        """The record as JSON, encoded once in its life after it is final (nothing changes a final record):
        the heartbeat writes the whole ring at every beat and step, and encoding it all each time cost
        about 0.5 ms of the 0.9 ms a step's heartbeat took (128 records, 2-core Xeon, 2026-11-27)."""
        if self.text is not None:
            return self.text
        final = self.state in FINAL_STATES  # read before encoding: a record finishing meanwhile is encoded again
        text = json.dumps(self.as_dict())
        if final:
            self.text = text
        return text


class FlightRecorder:
    """The last `capacity` collectives of this process (a CollectiveTracer for comm_log's wrappers)."""

    def __init__(self, rank: int, run_dir: Path | str | None, capacity: int = DEFAULT_CAPACITY, node: str | None = None):
        if capacity < 1:
            raise ValueError(f"flight recorder capacity = {capacity} is invalid: use 1 or more records")
        self.rank, self.run_dir = rank, Path(run_dir) if run_dir is not None else None
        self.node = node  # a job on several nodes: its dump goes to RUN/collectives/<node>/
        self.capacity = capacity
        self.step: int | None = None
        self.records: deque[CollectiveRecord] = deque(maxlen=capacity)
        self.groups: dict[tuple[str, tuple[int, ...]], dict] = {}  # (name, ranks) -> its last numbers
        self.recorded = 0
        self.version = 0  # bumped on every change, so the heartbeat writes only when there is news
        self.written_version = -1
        self.lock = threading.Lock()
        self.beat_lock = threading.Lock()  # the heartbeat thread and the main thread (progress) both write

    # --- CollectiveTracer: told by comm_log's wrappers, on whichever thread calls ---

    def issued(self, call: CollectiveCall) -> CollectiveRecord:
        record = CollectiveRecord()
        group = call.group
        record.op, record.kind, record.async_op = call.op, call.kind, call.async_op
        record.group, record.group_desc = group.group_name, getattr(group, "group_desc", None)
        record.group_ranks = dist.get_process_group_ranks(group)
        record.shapes = [tensor.shape for tensor in call.tensors]
        record.dtypes = [tensor.dtype for tensor in call.tensors]
        record.bytes, record.step = call.payload_bytes, self.step
        record.state, record.start_time, record.end_time, record.error = "issued", time.time(), None, None
        record.work = record.text = None
        key = (record.group, tuple(record.group_ranks))
        with self.lock:
            numbers = self.groups.get(key)
            if numbers is None:
                numbers = self.groups[key] = {"name": record.group, "desc": record.group_desc,
                                              "ranks": record.group_ranks, "seq": 0, "p2p_seq": 0}
            counter = "p2p_seq" if call.kind in POINT_TO_POINT else "seq"
            numbers[counter] += 1
            record.seq = numbers["seq"] if counter == "seq" else None
            record.p2p_seq = numbers["p2p_seq"] if counter == "p2p_seq" else None
            self.recorded += 1
            record.global_seq = self.recorded
            self.records.append(record)
            self.version += 1
        return record

    def returned(self, record: CollectiveRecord, work: dist.Work | None) -> None:
        if work is None:
            if not record.async_op:  # a functional collective stays "issued": its wait is not followed
                self._finish(record, "completed", time.time())
            return
        try:
            work.get_future().add_done_callback(lambda future: self._work_done(record, future))
        except RuntimeError:  # "getFuture not implemented": asked when the records are written (`_settle`)
            record.work = weakref.ref(work)

    def _work_done(self, record: CollectiveRecord, future) -> None:
        """An async call's Work finished (on the backend's thread): an error is dumped as a raise is.
        DDP's gradient all-reduce, for one, fails this way when a peer dies."""
        try:
            future.value()
        except Exception as error:  # the error itself also reaches whoever waits on the Work
            self.raised(record, error)
            return
        self._finish(record, "completed", time.time())

    def raised(self, record: CollectiveRecord, error: BaseException) -> None:
        record.error = _first_line(error)
        self._finish(record, "failed", time.time())
        group = f"{record.group} ({record.group_desc})" if record.group_desc else record.group
        self.dump(f"{record.op} #{record.seq or record.p2p_seq} on group {group} raised {record.error}")

    def _finish(self, record: CollectiveRecord, state: str, end_time: float | None) -> None:
        with self.lock:
            record.state, record.end_time = state, end_time
            self.version += 1

    def _settle(self) -> None:
        """Async calls without a future: "completed" once their Work says so, or "released" once the
        caller let go of it unseen (normally after waiting on it); when is not known."""
        for record in list(self.records):
            if record.work is None or record.state != "issued":
                continue
            work = record.work()
            if work is None:
                self._finish(record, "released", None)
            elif work.is_completed():
                self._finish(record, "completed", None)
            else:
                continue
            record.work = None

    # --- Writing ---

    def snapshot(self, reason: str, source: str = "dump") -> dict:
        return json.loads(self.snapshot_json(reason, source))

    def snapshot_json(self, reason: str, source: str = "dump") -> str:
        """The file's body as compact JSON (what `json.dumps` of `snapshot` gives), final records encoded once."""
        self._settle()
        with self.lock:
            records = [record.as_json() for record in self.records]
            groups = [dict(numbers) for numbers in self.groups.values()]
            recorded = self.recorded
        head = json.dumps({"rank": self.rank, "pid": os.getpid(), "host": socket.gethostname(), "reason": reason,
                           "time": time.time(), "source": source, "step": self.step, "capacity": self.capacity,
                           "recorded": recorded, "groups": groups, "records": []})
        return f"{head.removesuffix('[]}')}[{', '.join(records)}]}}"  # "records" is the last key

    def dump(self, reason: str) -> Path | None:
        """`RUN/collectives/rank<R>.json` now (atomically); its path, or None without a run directory
        or when it cannot be written (said on stderr: the error that led here matters more)."""
        if self.run_dir is None:
            return None
        path = collective_files.collectives_run_file(self.run_dir, self.rank, self.node)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            collective_files.write_text_atomic(path, json.dumps(self.snapshot(reason), indent=1))
        except OSError as err:
            print(f"shardwise: warning: could not write rank {self.rank}'s last collectives to {path}: {err}",
                  file=sys.stderr, flush=True)
            return None
        return path

    def write_beat(self, directory: Path) -> None:
        """The heartbeat hook (each beat, and each step's progress on the main thread): the records beside
        the heartbeat, when they changed since last written."""
        with self.beat_lock:
            self._settle()
            version = self.version  # read first: a change made while writing is written the next time
            if version == self.written_version:
                return
            # Compact: this one is written often; the launcher's copy in RUN/collectives is indented.
            collective_files.write_text_atomic(collective_files.collectives_beat_file(directory, self.rank),
                                               self.snapshot_json("heartbeat", source="heartbeat"))
            self.written_version = version


def capacity_of(text: str) -> int:
    """The ring's capacity as SHARDWISE_FR_BUFFER_SIZE gives it ("" = the default): more records to read
    many steps' collectives back after a stall (benchmarks/tp_skew.py), at ~0.5 KB of JSON a record per write."""
    if not text:
        return DEFAULT_CAPACITY
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"{RECORDER_CAPACITY_ENV} = {text!r} is invalid: use a whole number of collectives, 1 or more")
    return int(text)


def _first_line(error: BaseException) -> str:
    text = str(error).strip().split("\n", 1)[0]
    return f"{type(error).__name__}: {text[:_ERROR_CHARS]}"


@contextlib.contextmanager
def recording(recorder: FlightRecorder, heartbeat: Heartbeat | None = None) -> Iterator[FlightRecorder]:
    """Tell `recorder` of every collective of this process while inside, and leave its records beside
    `heartbeat`'s file at each beat and progress. Its log counts no functional collectives (no dispatch
    mode, no cost per op): those reach the recorder while a step's own log counts them."""
    if heartbeat is not None:
        heartbeat.add_hook(recorder.write_beat)
    try:
        with CommLog(functional_collectives=False, tracer=recorder):
            yield recorder
    finally:
        if heartbeat is not None:
            heartbeat.remove_hook(recorder.write_beat)
