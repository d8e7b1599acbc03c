"""The lease queue's rules, on the plain class with a controllable clock (no Ray needed)."""

from __future__ import annotations

import time
from typing import Any

import pytest

from actors.lease_keeper import LeaseKeeper, LeaseLost
from cluster.shard_queue import ShardQueue


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_an_expired_lease_goes_back_and_its_holder_can_no_longer_complete() -> None:
    clock = Clock()
    queue = ShardQueue([0, 1], lease_seconds=10, clock=clock)
    lease = queue.acquire("w1")
    assert lease is not None and lease.shard == 0
    clock.now = 5
    assert queue.heartbeat(lease.lease_id)  # renewed until t=15
    clock.now = 14
    assert queue.status().leased == 1
    clock.now = 16
    assert not queue.heartbeat(lease.lease_id)
    assert not queue.complete(lease.lease_id, {})
    again = queue.acquire("w2")
    assert again is not None and again.shard == 0  # a re-queued shard is handed out first
    assert queue.claim(again.lease_id) and queue.complete(again.lease_id, {"by": "w2"})
    assert queue.status().summaries == {0: {"by": "w2"}}


def test_a_shard_completes_once_and_only_by_its_holder() -> None:
    queue = ShardQueue([0])
    lease = queue.acquire("w1")
    assert lease is not None
    assert not queue.complete("not-a-lease", {})
    assert not queue.complete(lease.lease_id, {}), "completing needs the claim"
    assert queue.claim(lease.lease_id) and queue.complete(lease.lease_id, {})
    assert not queue.complete(lease.lease_id, {})
    queue.revoke(0)  # a completed shard is never queued again
    assert queue.acquire("w2") is None
    assert queue.status().finished


def test_a_dead_workers_shards_go_back_and_revoke_requeues() -> None:
    queue = ShardQueue([0, 1, 2])
    a, b = queue.acquire("dead"), queue.acquire("alive")
    assert a is not None and b is not None
    assert queue.release_worker("dead") == [a.shard]
    assert not queue.heartbeat(a.lease_id) and queue.heartbeat(b.lease_id)
    queue.revoke(b.shard)
    assert not queue.heartbeat(b.lease_id)
    status = queue.status()
    assert (status.pending, status.leased, status.completed) == (3, 0, 0)


def finish(queue: ShardQueue, worker: str) -> int:
    lease = queue.acquire(worker)
    assert lease is not None and queue.claim(lease.lease_id)
    assert queue.complete(lease.lease_id, {"by": worker})
    return lease.shard


def test_the_tail_reissues_a_straggler_deferred_and_the_first_claim_wins() -> None:
    clock = Clock()
    queue = ShardQueue([0, 1, 2], lease_seconds=1000, straggler_factor=2, straggler_min_seconds=5,
                       clock=clock)  # fmt: skip
    slow = queue.acquire("slow")
    assert slow is not None and not slow.deferred
    clock.now = 1
    finish(queue, "fast")  # 0 s each: the median shard time is 0
    finish(queue, "fast")
    clock.now = 4
    assert queue.acquire("fast") is None, "not a straggler before straggler_min_seconds"
    clock.now = 7
    assert queue.acquire("slow") is None, "never a duplicate of one's own shard"
    dup = queue.acquire("fast")
    assert dup is not None and dup.shard == slow.shard and dup.deferred
    assert queue.acquire("third") is None, "one duplicate per shard"
    # The original is mid-write when the duplicate claims: the claim wins, the original is
    # fenced off, and the claimant waits for the write in progress before writing its own.
    assert queue.begin_write(slow.lease_id)
    assert queue.claim(dup.lease_id)
    assert not queue.claim(slow.lease_id) and not queue.begin_write(slow.lease_id)
    assert not queue.fenced(dup.lease_id)
    queue.end_write(slow.lease_id)
    assert queue.fenced(dup.lease_id)
    assert not queue.complete(slow.lease_id, {})
    assert queue.complete(dup.lease_id, {"by": "fast"})
    status = queue.status()
    assert status.finished and status.summaries[slow.shard] == {"by": "fast"}


def test_a_shard_whose_former_holder_is_mid_write_is_handed_out_deferred() -> None:
    clock = Clock()
    queue = ShardQueue([0], lease_seconds=10, clock=clock)
    hung = queue.acquire("hung")
    assert hung is not None and queue.begin_write(hung.lease_id)
    clock.now = 11  # expired with a write in progress
    again = queue.acquire("next")
    assert again is not None and again.deferred and again.shard == 0
    assert queue.claim(again.lease_id) and not queue.fenced(again.lease_id)
    queue.end_write(hung.lease_id)
    assert queue.fenced(again.lease_id)
    queue.release(again.lease_id)
    clock.now = 12
    assert not queue.acquire("later").deferred, "nobody is mid-write any more"


def test_a_shard_failing_shard_attempts_times_is_given_up_with_its_reasons() -> None:
    queue = ShardQueue([0, 1], shard_attempts=2)
    first = queue.acquire("w1")
    queue.release(first.lease_id, "server crashed")
    second = queue.acquire("w2")
    assert second.shard == first.shard
    queue.release_worker("w2", "node lost")
    finish(queue, "w3")
    status = queue.status()
    assert status.finished and (status.completed, status.failed) == (1, 1)
    assert status.failures == {first.shard: ["w1: server crashed", "w2: node lost"]}
    assert queue.acquire("w4") is None


def test_a_holder_that_expired_mid_write_and_then_died_fences_nobody() -> None:
    clock = Clock()
    queue = ShardQueue([0], lease_seconds=10, clock=clock)
    hung = queue.acquire("w1")
    assert hung is not None and queue.begin_write(hung.lease_id)
    clock.now = 11  # expired with a write open: the next holder must wait for that write
    again = queue.acquire("w2")
    assert again is not None and again.deferred
    assert queue.release_worker("w1") == []  # then its worker dies, holding no lease any more
    assert queue.claim(again.lease_id) and queue.fenced(again.lease_id), "nothing is mid-write"


def test_a_shard_is_given_up_only_once_no_tail_duplicate_holds_it() -> None:
    for duplicate_succeeds in (True, False):
        clock = Clock()
        queue = ShardQueue([0, 1], lease_seconds=1000, shard_attempts=1, straggler_factor=1,
                           straggler_min_seconds=5, clock=clock)  # fmt: skip
        slow = queue.acquire("slow")
        finish(queue, "fast")
        clock.now = 10
        dup = queue.acquire("fast")
        assert dup is not None and dup.shard == slow.shard
        queue.release(slow.lease_id, "server crashed")  # its one attempt is used up
        status = queue.status()
        assert not status.finished and status.failed == 0, "the duplicate may still finish it"
        if duplicate_succeeds:
            assert queue.claim(dup.lease_id) and queue.complete(dup.lease_id, {"by": "fast"})
            expected = (2, 0)
        else:
            queue.release(dup.lease_id, "server crashed")
            expected = (1, 1)
        status = queue.status()
        assert status.finished and (status.completed, status.failed) == expected
        assert queue.acquire("idle") is None


def test_a_heartbeat_that_raises_loses_the_lease_and_says_why() -> None:
    queue = ShardQueue([0])
    lease = queue.acquire("w1")

    def call(method: str, *args: Any) -> Any:
        if method == "heartbeat":
            raise ConnectionError("the queue's node is gone")
        return getattr(queue, method)(*args)

    with LeaseKeeper(call, lease, interval=0.01) as keeper:
        deadline = time.monotonic() + 10
        while keeper.current():
            assert time.monotonic() < deadline, "the failed heartbeat went unnoticed"
            time.sleep(0.01)
        cause = "heartbeat failed: ConnectionError: the queue's node is gone"
        assert keeper.lost_cause == cause
        with pytest.raises(LeaseLost, match=cause), keeper.writing():
            pass
        with pytest.raises(LeaseLost, match=cause):
            keeper.claim_commit(timeout=1)
