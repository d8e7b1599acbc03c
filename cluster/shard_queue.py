"""The shared work queue: shards are leased, not popped, so no shard is lost with its worker.

A worker `acquire`s a lease, `heartbeat`s while it works and `complete`s the shard when its rows
and commit marker are written. A lease that is not renewed in time expires and its shard goes
back to the queue; so does the shard of a worker the driver reports dead (`release_worker`).
Only the current holder may complete a shard, and a shard completes once: a holder whose lease
was revoked or expired learns it from `heartbeat`/`complete` returning False and must stop.

Runs as one Ray actor (`ShardQueueActor`, num_cpus=0); the class itself is plain Python.
"""

from __future__ import annotations

import time
import uuid
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import ray


@dataclass(frozen=True)
class Lease:
    lease_id: str
    shard: int
    worker: str


@dataclass
class _Held:
    lease: Lease
    expires: float


@dataclass
class QueueStatus:
    pending: int
    leased: int
    completed: int
    total: int
    summaries: dict[int, dict[str, Any]] = field(default_factory=dict)

    @property
    def done(self) -> bool:
        return self.completed == self.total


class ShardQueue:
    def __init__(
        self,
        shards: Iterable[int],
        lease_seconds: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._pending: deque[int] = deque(shards)
        self._total = len(self._pending)
        self._held: dict[str, _Held] = {}  # lease_id -> lease
        self._completed: dict[int, dict[str, Any]] = {}  # shard -> summary
        self._lease_seconds = lease_seconds
        self._clock = clock

    def acquire(self, worker: str) -> Lease | None:
        """The next shard for `worker`, or None when nothing is left to hand out."""
        self._expire()
        if not self._pending:
            return None
        lease = Lease(uuid.uuid4().hex, self._pending.popleft(), worker)
        self._held[lease.lease_id] = _Held(lease, self._clock() + self._lease_seconds)
        return lease

    def heartbeat(self, lease_id: str) -> bool:
        """Renew a lease; False: it is gone (expired, revoked, released) and the holder must
        stop writing its shard at once."""
        self._expire()
        held = self._held.get(lease_id)
        if held is None:
            return False
        held.expires = self._clock() + self._lease_seconds
        return True

    def complete(self, lease_id: str, summary: dict[str, Any]) -> bool:
        """Mark the lease's shard done; only its current holder may, and only once."""
        self._expire()
        held = self._held.pop(lease_id, None)
        if held is None or held.lease.shard in self._completed:
            return False
        self._completed[held.lease.shard] = summary
        return True

    def release(self, lease_id: str) -> None:
        """The holder gives its shard back (for example, its server cannot be restarted)."""
        held = self._held.pop(lease_id, None)
        if held is not None:
            self._requeue(held.lease.shard)

    def revoke(self, shard: int) -> None:
        """Take a shard away from whoever holds it and queue it again."""
        for lease_id, held in list(self._held.items()):
            if held.lease.shard == shard:
                del self._held[lease_id]
                self._requeue(shard)

    def release_worker(self, worker: str) -> list[int]:
        """Queue again every shard a (dead) worker holds; returns them."""
        shards = [h.lease.shard for h in self._held.values() if h.lease.worker == worker]
        self._held = {k: h for k, h in self._held.items() if h.lease.worker != worker}
        for shard in shards:
            self._requeue(shard)
        return shards

    def status(self) -> QueueStatus:
        self._expire()
        return QueueStatus(
            pending=len(self._pending),
            leased=len(self._held),
            completed=len(self._completed),
            total=self._total,
            summaries=dict(self._completed),
        )

    def _expire(self) -> None:
        now = self._clock()
        for lease_id, held in list(self._held.items()):
            if held.expires < now:
                del self._held[lease_id]
                self._requeue(held.lease.shard)

    def _requeue(self, shard: int) -> None:
        if shard not in self._completed and shard not in self._pending:
            self._pending.appendleft(shard)  # retried first: the job's tail is what we wait on


ShardQueueActor = ray.remote(num_cpus=0)(ShardQueue)
