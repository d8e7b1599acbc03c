"""The worker's side of a lease: heartbeats, and the write fence the shard writer goes through.

Writes are fenced by time, with no queue call per write (docs/design/queue.md has the
protocol and why it is safe): a write may start only before the local deadline, (when the last
successful renewal was *asked for*) + the lease's `valid_seconds`, on this process's monotonic
clock. Heartbeats renew it; a refused or failed heartbeat, or a deadline passed, loses the lease.
The commit is claimed first (`claim`, first claim wins), then waits until no former holder of
the shard can still write. A holder that is done with a lease it did not win tells the queue it
writes nothing more (`stopped`), so a claimant waiting for it need not wait for its expiry.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

import ray

CLAIM_POLL_SECONDS = 1.0  # a claimant waiting for a former holder asks again this often


@dataclass(frozen=True)
class Lease:
    lease_id: str
    shard: int
    worker: str
    valid_seconds: float  # lease - margin: a write may start this long after asking to renew
    deferred: bool = False  # write rows only after a successful claim (see the queue's doc)
    # The longest a claim may wait for a former holder's writes: the queue's lease + margin
    # bounds that wait, twice that is the holder's give-up point.
    claim_timeout: float = 600.0


@dataclass(frozen=True)
class Claim:
    """The queue's answer to a claim: true once won; the winner writes only when `wait` is 0."""

    won: bool
    wait: float = 0.0  # seconds until no other lease of the shard can still write

    def __bool__(self) -> bool:
        return self.won


class LeaseLost(RuntimeError):
    """The worker no longer holds this shard's lease: it wrote nothing more and did not commit."""


class WriteFence(Protocol):
    lost_cause: str  # why the lease was lost, once current() is False

    def current(self) -> bool:
        """Cheap: False once the lease is known to be lost (no round trip)."""

    def writing(self) -> Any:
        """Context manager around one store write; raises LeaseLost if it may not write."""

    def claim_commit(self, timeout: float) -> None:
        """Win the shard's commit and wait until no other holder can still write; else
        LeaseLost."""


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
    ShardQueue in-process). It renews once on creation: when `acquire` was sent is unknown here,
    and the deadline must be measured from a request's send time."""

    def __init__(
        self,
        call: Callable[..., Any],
        lease: Lease,
        interval: float,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self._call, self.lease, self._interval = call, lease, interval
        self._clock, self._sleep = clock, sleep
        self._lock = threading.Lock()
        self._deadline = -math.inf  # local clock: no write may start from then on
        self._writes = 0  # store writes in progress
        self._unsure = False  # a write failed: it may still land, so never say `stopped`
        self._claimed = self._done = self._said_stopped = False
        self._refused = False  # the queue said the lease is gone (so it can be told things)
        self._lost = threading.Event()
        self.lost_cause = ""  # why, once lost
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, daemon=True, name="lease-heartbeat")
        self.renew()

    def __enter__(self) -> LeaseKeeper:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        self._done = True  # the holder writes nothing more through this keeper
        self._say_stopped()

    def renew(self) -> bool:
        """One heartbeat; on success the deadline moves to (when it was asked) + valid_seconds."""
        if self._lost.is_set():
            return False
        asked = self._clock()
        try:
            renewed = self._call("heartbeat", self.lease.lease_id)
        except Exception as exc:  # the queue unreachable: the lease cannot be known held
            self._lose(f"heartbeat failed: {type(exc).__name__}: {exc}")
            self._unsure = True  # nor can it be told anything
            return False
        if not renewed:
            self._refused = True
            self._lose("the queue refused the heartbeat (expired, revoked or claimed)")
            return False
        with self._lock:
            self._deadline = max(self._deadline, asked + self.lease.valid_seconds)
        return True

    def current(self) -> bool:
        return self._check() is None

    @contextmanager
    def writing(self):
        with self._lock:
            cause = self._check()
            if cause is None:
                self._writes += 1
        if cause is not None:
            raise LeaseLost(
                f"shard {self.lease.shard}: lease lost ({cause}), nothing more is written"
            )
        ok = False
        try:
            yield
            ok = True
        finally:
            with self._lock:
                self._writes -= 1
                self._unsure |= not ok
            if self._refused:  # the queue answers: tell it now, not when the shard is left
                self._say_stopped()

    def claim_commit(self, timeout: float) -> None:
        deadline = self._clock() + timeout
        while True:
            if self._lost.is_set():
                raise LeaseLost(f"shard {self.lease.shard}: lease lost ({self.lost_cause})")
            claim = self._call("claim", self.lease.lease_id)
            if not claim:
                self._lose("another worker claimed the shard first, or the lease is gone")
                raise LeaseLost(f"shard {self.lease.shard}: another worker claimed it first")
            self._claimed = True  # the winner completes: no `stopped` needed
            if claim.wait <= 0:
                return
            if self._clock() + claim.wait > deadline:
                raise TimeoutError(
                    f"shard {self.lease.shard}: a former holder may still write for "
                    f"{claim.wait:.0f} s, past the {timeout:.0f} s allowed; not committing over it"
                )
            self._sleep(min(claim.wait, CLAIM_POLL_SECONDS))

    # -- internals ----------------------------------------------------------------------------

    def _check(self) -> str | None:
        """Why no write may start now, if so (past the deadline: the lease is lost)."""
        if not self._lost.is_set() and self._clock() >= self._deadline:
            self._lose(
                f"not renewed within {self.lease.valid_seconds:.0f} s (lease - margin) of asking"
            )
        return self.lost_cause if self._lost.is_set() else None

    def _beat(self) -> None:
        while not self._stop.wait(self._interval):
            if not self.renew():
                self._say_stopped()  # at once if no write is in flight, else on exit
                return

    def _say_stopped(self) -> None:
        """Tell the queue this lease writes nothing more, once that is sure: lost or done, no
        write in flight, none failed (it may land late), and not the claim's winner."""
        with self._lock:
            if (
                self._said_stopped
                or self._writes
                or self._unsure
                or self._claimed
                or not (self._done or self._lost.is_set())
            ):
                return
            self._said_stopped = True
        with contextlib.suppress(Exception):  # else the window closes by time anyway
            self._call("stopped", self.lease.lease_id)

    def _lose(self, cause: str) -> None:
        if not self._lost.is_set():
            self.lost_cause = cause
            self._lost.set()
