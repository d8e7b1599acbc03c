"""The worker's side of a lease: heartbeats, and the write fence the shard writer goes through.

The store cannot check leases, so every write is bracketed by the queue (`begin_write` /
`end_write`) and the commit is claimed first (`claim`, first claim wins) and waits until no other
holder of the shard is mid-write (`fenced`). See cluster/shard_queue.py.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

import ray


@dataclass(frozen=True)
class Lease:
    lease_id: str
    shard: int
    worker: str
    deferred: bool = False  # write rows only after a successful claim (see the module doc)


class LeaseLost(RuntimeError):
    """The worker no longer holds this shard's lease: it wrote nothing more and did not commit."""


class WriteFence(Protocol):
    lost_cause: str  # why the lease was lost, once current() is False

    def current(self) -> bool:
        """Cheap: False once the lease is known to be lost (no round trip)."""

    def writing(self) -> Any:
        """Context manager around one store write; raises LeaseLost if it may not write."""

    def claim_commit(self, timeout: float) -> None:
        """Win the shard's commit and wait until no other holder is mid-write; else LeaseLost."""


class Unfenced:
    """For a store nobody else writes to (tests, single-process tools)."""

    lost_cause = ""

    def current(self) -> bool:
        return True

    @contextmanager
    def writing(self):
        yield

    def claim_commit(self, timeout: float) -> None:
        pass


def ray_caller(queue: Any) -> Callable[..., Any]:
    """Calls a ShardQueueActor method synchronously."""
    return lambda method, *args: ray.get(getattr(queue, method).remote(*args))


class LeaseKeeper:
    """Renews a lease in the background while its shard is processed, and fences the writes.
    `call(method, *args)` calls the queue (a Ray actor through `ray_caller`, or a plain
    ShardQueue in-process)."""

    def __init__(self, call: Callable[..., Any], lease: Lease, interval: float) -> None:
        self._call, self.lease, self._interval = call, lease, interval
        self._lost = threading.Event()
        self.lost_cause = ""  # why, once lost
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, daemon=True, name="lease-heartbeat")

    def __enter__(self) -> LeaseKeeper:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def current(self) -> bool:
        return not self._lost.is_set()

    @contextmanager
    def writing(self):
        if not self._lost.is_set() and not self._call("begin_write", self.lease.lease_id):
            self._lose("the queue refused the write (expired, revoked or claimed)")
        if self._lost.is_set():
            raise LeaseLost(
                f"shard {self.lease.shard}: lease lost ({self.lost_cause}), nothing more is written"
            )
        try:
            yield
        finally:
            self._call("end_write", self.lease.lease_id)

    def claim_commit(self, timeout: float) -> None:
        if self._lost.is_set():
            raise LeaseLost(f"shard {self.lease.shard}: lease lost ({self.lost_cause})")
        if not self._call("claim", self.lease.lease_id):
            self._lose("another worker claimed the shard first")
            raise LeaseLost(f"shard {self.lease.shard}: another worker claimed it first")
        deadline = time.monotonic() + timeout
        while not self._call("fenced", self.lease.lease_id):
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"shard {self.lease.shard}: a former holder is still mid-write after "
                    f"{timeout:.0f} s; not committing over it"
                )
            time.sleep(0.1)

    def _beat(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                renewed = self._call("heartbeat", self.lease.lease_id)
            except Exception as exc:  # the queue unreachable: the lease cannot be known held
                self._lose(f"heartbeat failed: {type(exc).__name__}: {exc}")
                return
            if not renewed:
                self._lose("the queue refused the heartbeat (expired, revoked or claimed)")
                return

    def _lose(self, cause: str) -> None:
        self.lost_cause = cause
        self._lost.set()
