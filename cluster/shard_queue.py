"""The shared work queue: shards are leased, not popped, so no shard is lost with its worker.

A worker `acquire`s a lease, `heartbeat`s while it works, brackets every store write with
`begin_write`/`end_write`, `claim`s the shard when its rows are in (the first claim wins) and
`complete`s it once its commit marker is written. A lease that is not renewed in time expires
and its shard goes back to the queue; so does the shard of a worker the driver reports dead
(`release_worker`) or that gives it back (`release`). A shard lost to failures `shard_attempts`
times is given up (`failed`), so one poisonous shard cannot keep the job alive forever; not
while a lease of it is still live (a tail duplicate may yet complete it), but once none is.

Exactly one lease's rows become visible. The store cannot check leases itself, so the queue
does it for the writers, as a lock manager with fencing: `begin_write` refuses a lease that is
not current, and a claimant waits (`fenced`) until no other lease of its shard is mid-write.
A lease that may overlap another live writer of its shard is `deferred`: it keeps its rows
aside and writes them only after its claim, so rows of a loser never mix with the winner's.
That is the case for the tail re-issue: once nothing is pending, an idle worker gets a deferred
duplicate of the shard that has been leased the longest, when that exceeds `straggler_factor`
times the median shard time (and `straggler_min_s`). Whichever copy claims first commits.

Runs as one Ray actor (`ShardQueueActor`, num_cpus=0); the class itself is plain Python.
"""

from __future__ import annotations

import statistics
import time
import uuid
from collections import Counter, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import ray

from actors.lease_keeper import Lease


@dataclass
class _Held:
    lease: Lease
    since: float
    expires: float


@dataclass
class QueueStatus:
    pending: int
    leased: int
    completed: int
    failed: int  # shards given up after shard_attempts failures
    total: int
    summaries: dict[int, dict[str, Any]] = field(default_factory=dict)
    failures: dict[int, list[str]] = field(default_factory=dict)  # shard -> reasons, in order

    @property
    def finished(self) -> bool:
        return self.completed + self.failed == self.total


class ShardQueue:
    def __init__(
        self,
        shards: Iterable[int],
        lease_seconds: float = 120.0,
        shard_attempts: int = 3,
        straggler_factor: float = 2.0,
        straggler_min_seconds: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._pending: deque[int] = deque(shards)
        self._total = len(self._pending)
        self._held: dict[str, _Held] = {}  # lease_id -> live lease
        self._claims: dict[int, str] = {}  # shard -> the lease that won its commit
        self._open: Counter[str] = Counter()  # lease_id -> writes begun, not ended
        self._issued: dict[str, Lease] = {}  # every lease ever issued, by id
        self._completed: dict[int, dict[str, Any]] = {}  # shard -> summary
        self._durations: list[float] = []  # lease to completion, completed shards
        self._failures: dict[int, list[str]] = {}
        self._failed: set[int] = set()
        self._lease_seconds, self._attempts = lease_seconds, shard_attempts
        self._straggler_factor, self._straggler_min = straggler_factor, straggler_min_seconds
        self._clock = clock

    # -- leases -------------------------------------------------------------------------------

    def acquire(self, worker: str) -> Lease | None:
        """The next shard for `worker`: a pending one, else (at the tail) a deferred duplicate
        of a straggler; None when there is nothing to do now (see `finished`)."""
        self._expire()
        if self._pending:
            shard = self._pending.popleft()
            # Someone else may still be mid-write on it (an expired holder): defer.
            deferred = any(self._issued[lid].shard == shard for lid in self._open)
            return self._issue(shard, worker, deferred)
        straggler = self._straggler(worker)
        return None if straggler is None else self._issue(straggler, worker, deferred=True)

    def heartbeat(self, lease_id: str) -> bool:
        """Renew a lease; False: it is gone (expired, revoked, released, lost its shard's claim)
        and the holder must stop writing its shard at once."""
        self._expire()
        held = self._held.get(lease_id)
        if held is None:
            return False
        held.expires = self._clock() + self._lease_seconds
        return True

    def begin_write(self, lease_id: str) -> bool:
        """May the holder write to its shard's part of the store now? Counted until end_write."""
        if not self.heartbeat(lease_id):
            return False
        self._open[lease_id] += 1
        return True

    def end_write(self, lease_id: str) -> None:
        if self._open[lease_id] > 1:
            self._open[lease_id] -= 1
        else:  # no zero entries: acquire and fenced scan the open writes on every call
            self._open.pop(lease_id, None)

    def claim(self, lease_id: str) -> bool:
        """First claim wins the right to commit the shard; every other lease of it is revoked
        (their holders learn it at their next heartbeat or write)."""
        if not self.heartbeat(lease_id):
            return False
        shard = self._held[lease_id].lease.shard
        if self._claims.get(shard, lease_id) != lease_id or shard in self._completed:
            return False
        self._claims[shard] = lease_id
        for other, held in list(self._held.items()):
            if held.lease.shard == shard and other != lease_id:
                del self._held[other]
        return True

    def fenced(self, lease_id: str) -> bool:
        """True once no other lease of this lease's shard has a write in progress."""
        shard = self._issued[lease_id].shard if lease_id in self._issued else None
        return not any(self._issued[lid].shard == shard and lid != lease_id for lid in self._open)

    def complete(self, lease_id: str, summary: dict[str, Any]) -> bool:
        """Mark the shard done; only the holder of its claim may, and only once."""
        self._expire()
        held = self._held.get(lease_id)
        if held is None or self._claims.get(held.lease.shard) != lease_id:
            return False
        del self._held[lease_id]
        self._completed[held.lease.shard] = summary
        self._durations.append(self._clock() - held.since)
        return True

    def release(self, lease_id: str, error: str | None = None) -> None:
        """The holder gives its shard back; `error` counts against the shard's attempts."""
        held = self._held.pop(lease_id, None)
        if held is not None:
            self._requeue(held.lease.shard, error and f"{held.lease.worker}: {error}")

    def revoke(self, shard: int) -> None:
        """Take a shard away from whoever holds it and queue it again."""
        for lease_id, held in list(self._held.items()):
            if held.lease.shard == shard:
                del self._held[lease_id]
                self._requeue(shard)

    def release_worker(self, worker: str, error: str = "worker died") -> list[int]:
        """Queue again every shard a dead worker holds, and forget its open writes, those of
        leases that expired mid-write included (a dead process writes nothing more); returns
        the shards."""
        for lease_id in [lid for lid in self._open if self._issued[lid].worker == worker]:
            del self._open[lease_id]
        mine = {lid: h for lid, h in self._held.items() if h.lease.worker == worker}
        for lease_id, held in mine.items():
            del self._held[lease_id]
            self._requeue(held.lease.shard, f"{worker}: {error}")
        return sorted(h.lease.shard for h in mine.values())

    # -- state ----------------------------------------------------------------------------------

    def status(self) -> QueueStatus:
        self._expire()
        return QueueStatus(
            pending=len(self._pending),
            leased=len({h.lease.shard for h in self._held.values()}),
            completed=len(self._completed),
            failed=len(self._failed),
            total=self._total,
            summaries=dict(self._completed),
            failures={k: list(v) for k, v in self._failures.items()},
        )

    def finished(self) -> bool:
        return self.status().finished

    # -- internals ------------------------------------------------------------------------------

    def _issue(self, shard: int, worker: str, deferred: bool) -> Lease:
        lease = Lease(uuid.uuid4().hex, shard, worker, deferred)
        now = self._clock()
        self._held[lease.lease_id] = _Held(lease, now, now + self._lease_seconds)
        self._issued[lease.lease_id] = lease
        return lease

    def _straggler(self, worker: str) -> int | None:
        """The longest-leased shard worth a duplicate for `worker`, if any."""
        if not self._durations:
            return None  # no shard time to compare with yet
        threshold = max(
            self._straggler_min, self._straggler_factor * statistics.median(self._durations)
        )
        by_shard: dict[int, list[_Held]] = {}
        for held in self._held.values():
            by_shard.setdefault(held.lease.shard, []).append(held)
        now = self._clock()
        candidates = [
            (min(h.since for h in helds), shard)
            for shard, helds in by_shard.items()
            if len(helds) == 1  # one duplicate per shard at most
            and helds[0].lease.worker != worker
            and shard not in self._claims
            and now - helds[0].since > threshold
        ]
        return min(candidates)[1] if candidates else None

    def _expire(self) -> None:
        now = self._clock()
        for lease_id, held in list(self._held.items()):
            if held.expires < now:
                del self._held[lease_id]
                self._requeue(held.lease.shard, f"{held.lease.worker}: lease expired")

    def _requeue(self, shard: int, error: str | None = None) -> None:
        if self._claims.get(shard) not in self._held:
            self._claims.pop(shard, None)  # the claimant is gone: the next holder may claim
        if error is not None:
            self._failures.setdefault(shard, []).append(error)
        held = any(h.lease.shard == shard for h in self._held.values())
        attempts_used = len(self._failures.get(shard, ())) >= self._attempts
        if attempts_used and not held and shard not in self._completed:
            self._failed.add(shard)  # not while a live lease (a tail duplicate) may complete it
        done = shard in self._completed or shard in self._failed
        if not done and not held and shard not in self._pending:
            self._pending.appendleft(shard)  # retried first: the job's tail is what we wait on


ShardQueueActor = ray.remote(num_cpus=0)(ShardQueue)
