"""One training at a time in a run directory: an advisory lock on `RUN/.lock`.

Two trainings writing one run directory interleave metrics.jsonl and race in each other's checkpoint
saves. The lock is `fcntl.flock` on `RUN/.lock`, held by the process that owns the whole job for its
lifetime: a one-process run itself; under `shardwise train --nproc N` the launcher, across its restarts
(its ranks take none, so they cannot refuse themselves). The kernel releases a flock when its holder
dies, however it dies, so a crashed or killed run leaves no stale lock: the file stays, with the last
holder's pid and host in it for the message, but only the flock counts.

Not covered: ranks started by `torchrun` directly (many nodes, examples/slurm): there is no single
process that owns the job; the scheduler's job name is the guard there. flock on NFS is local to
each client on old kernels; a run directory on a shared file system should not be used by two jobs.
"""

from __future__ import annotations

import fcntl
import os
import socket
from pathlib import Path

from shardwise.core.errors import invalid

LOCK_FILE = ".lock"


class RunLock:
    """The lock of `run_dir`; `acquire()` takes it or raises the one-line refusal, leaving the
    release to `release()` or the end of a `with` block (or the process's death)."""

    def __init__(self, run_dir: str | Path):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_FILE
        self.fd: int | None = None

    def acquire(self) -> RunLock:
        if self.fd is not None:
            return self
        self.run_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)  # no truncation: the holder's line stays
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise invalid("run.dir", str(self.run_dir),
                          f"another training is using it ({holder}); wait for it to end, or use a new --run.dir"
                          ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        self.fd = fd
        return self

    def release(self) -> None:
        """Unlocks by closing; the file is left in place (removing it would let a process that opened it
        before the removal lock a file no one else sees)."""
        if self.fd is not None:
            fd, self.fd = self.fd, None
            os.close(fd)

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()
