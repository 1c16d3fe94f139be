"""Persistent worker processes on one process group, for running many short jobs.

Starting N processes and a process group costs seconds (importing torch dominates); a test
module or a benchmark that tries ten layouts pays it once with `WorkerPool(n)` and then calls
`pool.run(fn, *args)` per layout. `fn` must be importable (a module-level function); it runs
on every rank, and the results come back in rank order. A failing rank's traceback is raised
in the caller, and the workers keep serving.
"""

from __future__ import annotations

import queue
import socket
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

JOB_TIMEOUT_S = 600


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_main(rank: int, world_size: int, port: int, backend: str, threads: int, jobs, results) -> None:
    torch.set_num_threads(threads)  # n processes share the machine's cores
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    while True:
        job = jobs.get()
        if job is None:
            break
        fn, args = job
        try:
            results.put((rank, True, fn(*args)))
        except BaseException:  # report, keep serving: a failed job must not hang the others
            results.put((rank, False, traceback.format_exc()))
    dist.destroy_process_group()


class WorkerPool:
    def __init__(self, world_size: int, *, backend: str = "gloo", threads: int = 1):
        ctx = mp.get_context("spawn")
        self.world_size = world_size
        self.jobs = [ctx.Queue() for _ in range(world_size)]
        self.results = ctx.Queue()
        port = free_port()
        self.procs = [
            ctx.Process(target=worker_main, args=(r, world_size, port, backend, threads, self.jobs[r], self.results),
                        daemon=True)
            for r in range(world_size)
        ]
        for p in self.procs:
            p.start()

    def run(self, fn, *args) -> list:
        """fn(*args) on every rank; the results in rank order (raises if any rank failed)."""
        for q in self.jobs:
            q.put((fn, args))
        by_rank, failures = {}, []
        for _ in range(self.world_size):
            try:
                rank, ok, value = self.results.get(timeout=JOB_TIMEOUT_S)
            except queue.Empty:
                raise TimeoutError(f"a rank did not answer within {JOB_TIMEOUT_S}s") from None
            by_rank[rank] = value
            if not ok:
                failures.append(f"rank {rank}:\n{value}")
        if failures:
            raise RuntimeError("\n".join(failures))
        return [by_rank[r] for r in range(self.world_size)]

    def close(self) -> None:
        for q in self.jobs:
            q.put(None)
        for p in self.procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()

    def __enter__(self) -> "WorkerPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
