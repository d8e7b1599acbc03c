"""The shared work queue: shards are leased, not popped, so no shard is lost with its worker.

A worker `acquire`s a lease, `heartbeat`s while it works, `claim`s the shard when its rows are in
(the first claim wins) and `complete`s it once its commit marker is written; nothing per chunk.
Expired leases and dead workers' shards (`release_worker`) go back to the queue; a shard lost
`shard_attempts` times is given up. Shards may be added while the job runs (`more_coming`,
`add`, `close`). At the tail an idle worker gets a deferred duplicate of the slowest shard.

Stale holders are fenced by time, not by the store: a lease's write window stays open until its
expiry + margin (or its `stopped`); a lease is `deferred` while another lease of its shard has
an open window; `claim` tells the winner how long until every other window is closed. Runs as
one Ray actor (`ShardQueueActor`, num_cpus=0); the class itself is plain Python.

The protocol, and the proof that no stale write lands in a committed shard:
docs/design/queue.md.
"""

from __future__ import annotations

import heapq
import statistics
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import ray

from actors.lease_keeper import Claim, Lease


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
    closed: bool = True  # no more shards will be added

    @property
    def finished(self) -> bool:
        return self.closed and self.completed + self.failed == self.total


class ShardQueue:
    def __init__(
        self,
        shards: Iterable[int] = (),
        lease_seconds: float = 300.0,
        shard_attempts: int = 3,
        straggler_factor: float = 2.0,
        straggler_min_seconds: float = 60.0,
        *,
        margin_seconds: float | None = None,
        more_coming: bool = False,
        write_after_claim: bool = False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`margin_seconds`: None is half the lease (the job config passes one checked against
        the store's write timeouts). `write_after_claim`: every lease is deferred, for work
        whose one write follows its claim (a part of prompts' responses): a holder lost before
        it claimed leaves no write window open, and its successor's claim need not wait."""
        margin = lease_seconds / 2 if margin_seconds is None else margin_seconds
        if not 0 < margin < lease_seconds:
            raise ValueError(f"need 0 < margin ({margin}) < lease ({lease_seconds})")
        self._pending: deque[int] = deque()
        self._queued: set[int] = set()  # the shards in _pending
        self._known: set[int] = set()  # every shard ever added
        self._total, self._closed = 0, False
        self._held: dict[str, _Held] = {}  # lease_id -> live lease
        self._holders: dict[int, set[str]] = {}  # shard -> its live leases (no empty sets)
        self._expiries: list[tuple[float, str]] = []  # heap; entries of renewed leases are stale
        self._windows: dict[int, dict[str, float]] = {}  # shard -> lease -> its window's end
        self._claims: dict[int, str] = {}  # shard -> the lease that won its commit
        self._completed: dict[int, dict[str, Any]] = {}  # shard -> summary
        self._durations: list[float] = []  # lease to completion, completed shards
        self._failures: dict[int, list[str]] = {}
        self._failed: set[int] = set()
        self._lease_seconds, self._margin, self._attempts = lease_seconds, margin, shard_attempts
        self._straggler_factor, self._straggler_min = straggler_factor, straggler_min_seconds
        self._clock = clock
        self._write_after_claim = write_after_claim
        self.add(shards)
        self._closed = not more_coming

    # -- planning -----------------------------------------------------------------------------

    def add(self, shards: Iterable[int]) -> None:
        """Planned shards, queued after those already pending."""
        if self._closed:
            raise ValueError("the queue is closed: no more shards can be added")
        shards = list(shards)
        known = self._known.intersection(shards)
        if known or len(set(shards)) != len(shards):
            raise ValueError(f"shards added twice: {sorted(known) or shards}")
        self._known.update(shards)
        self._queued.update(shards)
        self._pending.extend(shards)
        self._total += len(shards)

    def close(self) -> None:
        """No more shards will be added: the queue can finish."""
        self._closed = True

    # -- leases -------------------------------------------------------------------------------

    def acquire(self, worker: str) -> Lease | None:
        """The next shard for `worker`: a pending one, else (at the tail) a deferred duplicate
        of a straggler; None when there is nothing to do now (see `finished`)."""
        self._expire()
        if self._pending:
            shard = self._pending.popleft()
            self._queued.discard(shard)
            # A former holder may still be writing it (within its window): defer.
            deferred = self._write_after_claim or bool(self._open_windows(shard))
            return self._issue(shard, worker, deferred=deferred)
        if not self._closed:  # planning is behind capture: not the tail yet
            return None
        straggler = self._straggler(worker)
        return None if straggler is None else self._issue(straggler, worker, deferred=True)

    def heartbeat(self, lease_id: str) -> bool:
        """Renew a lease; False: it is gone (expired, revoked, released, lost its shard's claim)
        and the holder must stop writing its shard at once."""
        self._expire()
        held = self._held.get(lease_id)
        if held is None:
            return False
        self._renew(held)
        return True

    def claim(self, lease_id: str) -> Claim:
        """The first claim wins the right to commit the shard and revokes every other lease of
        it (their holders learn it at their next heartbeat). Lost if this lease cannot commit
        (gone, or another claimed first); won, with the seconds until no other lease of the
        shard can still write: the winner writes once a claim (asked again) says 0."""
        if not self.heartbeat(lease_id):
            return Claim(False)
        shard = self._held[lease_id].lease.shard
        if self._claims.get(shard, lease_id) != lease_id or shard in self._completed:
            return Claim(False)
        self._claims[shard] = lease_id
        self._renew(self._held[lease_id])  # a deferred lease's window opens with its claim
        for other in self._holders[shard] - {lease_id}:
            self._drop(other)  # revoked; its window stays open until it stops or ends
        ends = self._open_windows(shard, but=lease_id)
        return Claim(True, max(ends) - self._clock() if ends else 0.0)

    def stopped(self, lease_id: str) -> None:
        """The holder will write nothing more (every write it began has returned): close its
        window now rather than at expiry + margin."""
        for windows in self._windows.values():
            if windows.pop(lease_id, None) is not None:
                return

    def complete(self, lease_id: str, summary: dict[str, Any]) -> bool:
        """Mark the shard done; only the holder of its claim may, and only once."""
        self._expire()
        held = self._held.get(lease_id)
        if held is None or self._claims.get(held.lease.shard) != lease_id:
            return False
        shard = held.lease.shard
        self._drop(lease_id)
        self._windows.pop(shard, None)  # never issued again: no window matters any more
        self._completed[shard] = summary
        self._durations.append(self._clock() - held.since)
        return True

    def release(self, lease_id: str, error: str | None = None) -> None:
        """The holder gives its shard back; `error` counts against the shard's attempts. Its
        window stays open (a write of it that failed may still land) unless it says `stopped`."""
        held = self._drop(lease_id)
        if held is not None:
            self._requeue(held.lease.shard, error and f"{held.lease.worker}: {error}")

    def revoke(self, shard: int) -> None:
        """Take a shard away from whoever holds it and queue it again."""
        for lease_id in list(self._holders.get(shard, ())):
            self._drop(lease_id)
            self._requeue(shard)

    def release_worker(self, worker: str, error: str = "worker died") -> list[int]:
        """Queue again every shard a dead worker holds; returns them. Their windows stay open
        until they end: see the module doc."""
        mine = [h for h in self._held.values() if h.lease.worker == worker]
        for held in mine:
            self._drop(held.lease.lease_id)
            self._requeue(held.lease.shard, f"{worker}: {error}")
        return sorted(h.lease.shard for h in mine)

    # -- state ----------------------------------------------------------------------------------

    def status(self) -> QueueStatus:
        self._expire()
        return QueueStatus(
            pending=len(self._pending),
            leased=len(self._holders),
            completed=len(self._completed),
            failed=len(self._failed),
            total=self._total,
            summaries=dict(self._completed),
            failures={k: list(v) for k, v in self._failures.items()},
            closed=self._closed,
        )

    def outcome(self, shard: int) -> tuple[str, list[str]] | None:
        """("completed", []) or ("given up", its failures in order) for a shard that is done;
        None while it may still be completed. Cheaper than status() for one shard."""
        self._expire()
        if shard in self._completed:
            return "completed", []
        if shard in self._failed:
            return "given up", list(self._failures.get(shard, []))
        return None

    def finished(self) -> bool:
        """Cheaper than status().finished (no summaries copied): idle workers poll it."""
        self._expire()
        return self._closed and len(self._completed) + len(self._failed) == self._total

    # -- internals ------------------------------------------------------------------------------

    def _issue(self, shard: int, worker: str, deferred: bool) -> Lease:
        valid = self._lease_seconds - self._margin
        claim_timeout = 2 * (self._lease_seconds + self._margin)
        lease = Lease(uuid.uuid4().hex, shard, worker, valid, deferred, claim_timeout)
        held = _Held(lease, self._clock(), 0.0)
        self._held[lease.lease_id] = held
        self._holders.setdefault(shard, set()).add(lease.lease_id)
        self._renew(held)
        return lease

    def _renew(self, held: _Held) -> None:
        held.expires = self._clock() + self._lease_seconds
        heapq.heappush(self._expiries, (held.expires, held.lease.lease_id))
        lease = held.lease
        if lease.deferred and self._claims.get(lease.shard) != lease.lease_id:
            return  # it writes nothing before it wins the claim: no window to keep open
        windows = self._windows.setdefault(lease.shard, {})
        windows[lease.lease_id] = held.expires + self._margin

    def _drop(self, lease_id: str) -> _Held | None:
        """No longer live (its window is left as it is)."""
        held = self._held.pop(lease_id, None)
        if held is not None:
            holders = self._holders[held.lease.shard]
            holders.discard(lease_id)
            if not holders:
                del self._holders[held.lease.shard]
        return held

    def _open_windows(self, shard: int, but: str | None = None) -> list[float]:
        """The ends of the shard's write windows still open, other than `but`'s."""
        windows = self._windows.get(shard)
        if not windows:
            return []
        now = self._clock()
        for lease_id in [lid for lid, end in windows.items() if end <= now]:
            del windows[lease_id]
        if not windows:
            del self._windows[shard]
        return [end for lid, end in windows.items() if lid != but]

    def _straggler(self, worker: str) -> int | None:
        """The longest-leased shard worth a duplicate for `worker`, if any."""
        if not self._durations:
            return None  # no shard time to compare with yet
        threshold = max(
            self._straggler_min, self._straggler_factor * statistics.median(self._durations)
        )
        now = self._clock()
        candidates = []
        for shard, leases in self._holders.items():
            if len(leases) != 1 or shard in self._claims:  # one duplicate per shard at most
                continue
            held = self._held[next(iter(leases))]
            if held.lease.worker != worker and now - held.since > threshold:
                candidates.append((held.since, shard))
        return min(candidates)[1] if candidates else None

    def _expire(self) -> None:
        now = self._clock()
        while self._expiries and self._expiries[0][0] < now:
            expires, lease_id = heapq.heappop(self._expiries)
            held = self._held.get(lease_id)
            if held is not None and held.expires == expires:  # not renewed since
                self._drop(lease_id)
                self._requeue(held.lease.shard, f"{held.lease.worker}: lease expired")

    def _requeue(self, shard: int, error: str | None = None) -> None:
        if self._claims.get(shard) not in self._held:
            self._claims.pop(shard, None)  # the claimant is gone: the next holder may claim
        if error is not None:
            self._failures.setdefault(shard, []).append(error)
        held = shard in self._holders
        attempts_used = len(self._failures.get(shard, ())) >= self._attempts
        if attempts_used and not held and shard not in self._completed:
            self._failed.add(shard)  # not while a live lease (a tail duplicate) may complete it
        done = shard in self._completed or shard in self._failed
        if not done and not held and shard not in self._queued:
            self._pending.appendleft(shard)  # retried first: the job's tail is what we wait on
            self._queued.add(shard)


ShardQueueActor = ray.remote(num_cpus=0)(ShardQueue)
