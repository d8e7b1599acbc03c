"""The lease queue's rules, on the plain class with a controllable clock (no Ray needed)."""

from __future__ import annotations

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
    assert queue.complete(again.lease_id, {"by": "w2"})
    assert queue.status().summaries == {0: {"by": "w2"}}


def test_a_shard_completes_once_and_only_by_its_holder() -> None:
    queue = ShardQueue([0])
    lease = queue.acquire("w1")
    assert lease is not None
    assert not queue.complete("not-a-lease", {})
    assert queue.complete(lease.lease_id, {})
    assert not queue.complete(lease.lease_id, {})
    queue.revoke(0)  # a completed shard is never queued again
    assert queue.acquire("w2") is None
    assert queue.status().done


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
