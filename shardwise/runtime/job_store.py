"""The job's store: one key-value store every node's launcher reaches, at the rendezvous endpoint.

The head node's launcher hosts it (a torch `TCPStore`, multi-tenant), before and across every launch of the
ranks: torch's c10d rendezvous backend, started at the same endpoint in the same process, shares the same
server (that is what multi-tenant means), so one port serves both. The other nodes' launchers connect as
clients. Through it go what one machine's files cannot carry across machines: each node's configuration
for the handshake (runtime/node_check.py), each node's heartbeats for the job-wide watchdog
(runtime/job_watch.py) and the head's decisions (stop, restart, grow; runtime/launch_nodes.py).

Keys are JSON under `shardwise/<job id>/`. Every read is a `check` then a `get`, never a blocking wait, so a
thread polling it never hangs on a key that will not come; one lock serialises the threads' use of the one
client.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
import uuid
from datetime import timedelta

from shardwise.runtime.nodes import NodeSpec


class StoreUnreachable(Exception):
    """The head's store did not answer within the rendezvous timeout, or stopped answering (the head ended)."""


class JobStore:
    def __init__(self, store, prefix: str):
        self.store, self.prefix = store, prefix
        self.lock = threading.Lock()
        self.incarnation = uuid.uuid4().hex[:8]
        """This launcher among all that ever held its node rank (a node started again is another one)."""

    @classmethod
    def open(cls, spec: NodeSpec) -> JobStore:
        """Host the store (head) or connect to it; StoreUnreachable after spec.rdzv_timeout_s."""
        from torch.distributed import TCPStore

        try:
            store = TCPStore(spec.host, spec.port, is_master=spec.is_head, multi_tenant=True, wait_for_workers=False,
                             timeout=timedelta(seconds=spec.rdzv_timeout_s))
        except (RuntimeError, ValueError, TimeoutError) as err:  # DistNetworkError/DistStoreError are RuntimeErrors
            what = "bind" if spec.is_head else "reach"
            raise StoreUnreachable(f"could not {what} the rendezvous endpoint {spec.endpoint} "
                                   f"({str(err).strip().splitlines()[0][:160]})") from None
        return cls(store, f"shardwise/{spec.job_id}/")

    def set(self, key: str, value) -> None:
        with self.answering():
            self.store.set(self.prefix + key, json.dumps(value))

    def get(self, key: str, default=None):
        """The value at `key`, or `default` when there is none (yet)."""
        with self.answering():
            if not self.store.check([self.prefix + key]):
                return default
            return json.loads(self.store.get(self.prefix + key))

    def add(self, key: str, amount: int = 1) -> int:
        with self.answering():
            return int(self.store.add(self.prefix + key, amount))

    @contextlib.contextmanager
    def answering(self):
        """One client call at a time; a store gone away (the head's launcher ended) is StoreUnreachable."""
        with self.lock:
            try:
                yield
            except (RuntimeError, TimeoutError) as err:  # torch's DistNetworkError and DistStoreError
                raise StoreUnreachable(f"the job's store on node 0 stopped answering "
                                       f"({str(err).strip().splitlines()[0][:120]})") from None

    def poll(self, key: str, timeout_s: float, interval_s: float = 0.05, default=None):
        """`get` until `key` is there or `timeout_s` passed."""
        deadline = time.monotonic() + timeout_s
        while True:
            value = self.get(key)
            if value is not None or time.monotonic() >= deadline:
                return default if value is None else value
            time.sleep(interval_s)
