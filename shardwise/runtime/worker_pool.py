"""Run many short multi-process jobs, each on fresh ranks with a process group of its own.

`WorkerPool(n).run(fn, *args)` runs `fn(*args)` on n ranks joined in a gloo process group (or
`backend`) and returns the results in rank order; a failing rank's traceback is raised in the
caller. `fn` must be importable (a module-level function). A test session or a benchmark that
tries ten layouts makes one pool and calls `run` per layout.

Starting a Python process that imports torch costs seconds; forking one that has costs
milliseconds. So the ranks of each job are forked from one server process that imported torch
and `preload` once (Python's forkserver, shared by every pool of the process), they build the
job's process group, run `fn`, destroy the group and exit. Nothing a job creates outlives it, and
there is nothing to reset between jobs. Ranks that lived for many jobs (our earlier pools) kept
every layout's gloo groups: torch caches DeviceMeshes (DTensor's sharding and redistribution
plans, mesh topology), a mesh holds its groups, and each group holds three threads; after a
third of the test suite a 2-rank pool's ranks held 100 groups and 290 threads each, which poll.
Forked ranks ran six layouts as fast as long-lived ones (6.8 s and 7.5 s, 2 ranks, 2 CPU cores).
"""

from __future__ import annotations

import os
import pickle
import queue
import sys
import tempfile
import time
import traceback
from collections.abc import Sequence
from multiprocessing import forkserver

import torch.distributed as dist
import torch.multiprocessing as mp

JOB_TIMEOUT_S = 600
FAILED_PEER_GRACE_S = 30
PRELOAD = ("torch", "torch.distributed", "torch.distributed.tensor", "torch.distributed.fsdp",
           "torch.distributed.pipelining", "shardwise.train.trainer")
"""What the fork server imports once, so that no rank imports it again."""


def run_rank(rank: int, world_size: int, store_path: str, backend: str, threads: int, fn, args, results) -> None:
    """One rank of one job: its process group around fn(*args), its result (or traceback) on `results`."""
    import torch

    torch.set_num_threads(threads)  # n ranks share the machine's cores
    try:
        dist.init_process_group(backend, store=dist.FileStore(store_path, world_size), rank=rank,
                                world_size=world_size)
        try:
            # pickled by value here: a queue would share a tensor's memory through this process, gone by then
            results.put((rank, True, pickle.dumps(fn(*args))))
        finally:
            if dist.is_initialized():  # (unless fn destroyed it itself)
                dist.destroy_process_group()
    except BaseException:  # report: the caller must not wait for a rank that failed
        results.put((rank, False, traceback.format_exc()))


def start_fork_server() -> None:
    """Start the fork server (once per process) with this process's sys.path, so that it can preload
    what this process can import (Python 3.11's server is handed sys.path and does not apply it;
    each rank forked from it applies it again, as spawned processes do)."""
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(path for path in sys.path if path)
    try:
        forkserver.ensure_running()
    finally:
        if saved is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = saved


def collect(ranks: list, results) -> dict[int, tuple[bool, object]]:
    """Each rank's (ok, result or traceback); a rank that dies without a word fails the job at once."""
    by_rank, deadline = {}, time.monotonic() + JOB_TIMEOUT_S
    while len(by_rank) < len(ranks):
        try:
            rank, ok, value = results.get(timeout=1)
            by_rank[rank] = (ok, pickle.loads(value) if ok else value)
            if not ok:  # its peers may wait in a collective it never joins: they get a while to notice
                deadline = min(deadline, time.monotonic() + FAILED_PEER_GRACE_S)
            continue
        except queue.Empty:
            pass
        # a rank flushes its result before it exits: dead and nothing queued means it never sent one
        dead = [r for r, p in enumerate(ranks) if r not in by_rank and p.exitcode is not None]
        if dead and results.empty():
            raise RuntimeError(f"rank {dead[0]} exited with code {ranks[dead[0]].exitcode} and no result")
        if time.monotonic() > deadline:
            failed = {r: value for r, (ok, value) in by_rank.items() if not ok}
            if failed:
                raise RuntimeError("\n".join(f"rank {r}:\n{value}" for r, value in sorted(failed.items())))
            raise TimeoutError(f"a rank did not answer within {JOB_TIMEOUT_S}s")
    return by_rank


class WorkerPool:
    def __init__(self, world_size: int, *, backend: str = "gloo", threads: int = 1,
                 preload: Sequence[str] = PRELOAD):
        self.world_size, self.backend, self.threads = world_size, backend, threads
        self.context = mp.get_context("forkserver")
        self.context.set_forkserver_preload(list(preload))  # heeded by the server's start, here or earlier
        start_fork_server()

    def run(self, fn, *args) -> list:
        """fn(*args) on every rank of a fresh process group; the results in rank order (raises if
        any rank failed)."""
        results = self.context.Queue()  # one per job: nothing a failed job left can be read as this one's
        with tempfile.TemporaryDirectory(prefix="shardwise-pool-") as folder:
            store_path = os.path.join(folder, "store")
            ranks = [self.context.Process(target=run_rank, daemon=True,
                                          args=(r, self.world_size, store_path, self.backend, self.threads, fn, args,
                                                results))
                     for r in range(self.world_size)]
            for process in ranks:
                process.start()
            try:
                by_rank = collect(ranks, results)
            except BaseException:
                for process in ranks:
                    process.kill()
                raise
            finally:
                for process in ranks:
                    process.join(timeout=30)  # it has answered: only its exit is left
                    if process.is_alive():
                        process.kill()
        failures = [f"rank {rank}:\n{value}" for rank, (ok, value) in sorted(by_rank.items()) if not ok]
        if failures:
            raise RuntimeError("\n".join(failures))
        return [by_rank[r][1] for r in range(self.world_size)]

    def close(self) -> None:
        """Nothing to stop: each job's ranks have exited when `run` returns."""

    def __enter__(self) -> "WorkerPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
