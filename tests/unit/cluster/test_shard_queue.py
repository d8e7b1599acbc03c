"""The lease queue's rules and the holder's time fence, on the plain class with controlled clocks
(no Ray, no threads but where a heartbeat thread is the point)."""

from __future__ import annotations

import time
from typing import Any

import pytest

from actors.lease_keeper import Claim, Lease, LeaseKeeper, LeaseLost
from cluster.shard_queue import ShardQueue


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def caller(queue: ShardQueue, log: list[str] | None = None) -> Any:
    def call(method: str, *args: Any) -> Any:
        if log is not None:
            log.append(method)
        return getattr(queue, method)(*args)

    return call


def keeper(queue: ShardQueue, lease: Lease, clock: Clock, log: list[str] | None = None):
    """A holder on the same controlled clock as the queue (no heartbeat thread: renew() is
    called by the test); its claim wait advances the clock instead of sleeping."""

    def sleep(seconds: float) -> None:
        clock.now += seconds

    return LeaseKeeper(caller(queue, log), lease, interval=3600, clock=clock, sleep=sleep)


def write(fence: LeaseKeeper) -> None:
    with fence.writing():
        pass


def test_an_expired_lease_goes_back_and_its_holder_can_no_longer_complete() -> None:
    clock = Clock()
    queue = ShardQueue([0, 1], lease_seconds=10, margin_seconds=4, clock=clock)
    lease = queue.acquire("w1")
    assert lease is not None and lease.shard == 0 and lease.valid_seconds == 6
    # A claim waits at most lease + margin for a former holder; the holder gives up at twice.
    assert lease.claim_timeout == 2 * (10 + 4)
    clock.now = 5
    assert queue.heartbeat(lease.lease_id)  # renewed until t=15
    clock.now = 14
    assert queue.status().leased == 1
    clock.now = 16
    assert not queue.heartbeat(lease.lease_id)
    assert not queue.complete(lease.lease_id, {})
    again = queue.acquire("w2")
    assert again is not None and again.shard == 0  # a re-queued shard is handed out first
    assert again.deferred, "w1 may still be writing until 15 + 4"
    assert queue.claim(again.lease_id).wait == pytest.approx(3.0)
    clock.now = 19
    assert queue.claim(again.lease_id) == Claim(True)
    assert queue.complete(again.lease_id, {"by": "w2"})
    assert queue.status().summaries == {0: {"by": "w2"}}


def test_a_shard_completes_once_and_only_by_its_holder() -> None:
    queue = ShardQueue([0])
    lease = queue.acquire("w1")
    assert lease is not None
    assert not queue.complete("not-a-lease", {})
    assert not queue.complete(lease.lease_id, {}), "completing needs the claim"
    assert queue.claim(lease.lease_id) == Claim(True) and queue.complete(lease.lease_id, {})
    assert not queue.complete(lease.lease_id, {})
    assert not queue.claim(lease.lease_id)
    queue.revoke(0)  # a completed shard is never queued again
    assert queue.acquire("w2") is None
    assert queue.status().finished


def test_a_dead_workers_shards_go_back_at_once_deferred_until_its_windows_end() -> None:
    clock = Clock()
    queue = ShardQueue([0, 1, 2], lease_seconds=10, margin_seconds=4, clock=clock)
    a, b = queue.acquire("dead"), queue.acquire("alive")
    assert a is not None and b is not None
    assert queue.release_worker("dead") == [a.shard]
    assert not queue.heartbeat(a.lease_id) and queue.heartbeat(b.lease_id)
    # A node declared dead may be partitioned, still writing until its deadline.
    again = queue.acquire("next")
    assert again is not None and again.shard == a.shard and again.deferred
    assert queue.claim(again.lease_id).wait == pytest.approx(14.0)
    queue.revoke(b.shard)
    assert not queue.heartbeat(b.lease_id)
    status = queue.status()
    assert (status.pending, status.leased, status.completed) == (2, 1, 0)


def test_with_write_after_claim_only_a_dead_claimant_fences_its_successor() -> None:
    """A part of prompts is written once, after its claim: a holder lost before claiming can
    never write, so its successor claims at once; one lost after claiming may still have its
    write in flight, so its successor waits for that window."""
    clock = Clock()
    queue = ShardQueue([0, 1], lease_seconds=10, margin_seconds=4, write_after_claim=True,
                       clock=clock)  # fmt: skip
    unclaimed, claimed = queue.acquire("dead"), queue.acquire("dead")
    assert unclaimed is not None and claimed is not None and unclaimed.deferred
    assert queue.claim(claimed.lease_id) == Claim(True, 0.0)
    assert sorted(queue.release_worker("dead")) == [0, 1]
    again = {
        lease.shard: lease for lease in (queue.acquire("next"), queue.acquire("next")) if lease
    }
    assert queue.claim(again[unclaimed.shard].lease_id) == Claim(True, 0.0)
    assert queue.claim(again[claimed.shard].lease_id).wait == pytest.approx(14.0)


def finish(queue: ShardQueue, worker: str) -> int:
    lease = queue.acquire(worker)
    assert lease is not None and queue.claim(lease.lease_id) == Claim(True)
    assert queue.complete(lease.lease_id, {"by": worker})
    return lease.shard


@pytest.mark.parametrize("renewed", [False, True])
def test_a_write_may_start_only_before_asked_for_renewal_plus_lease_minus_margin(
    renewed: bool,
) -> None:
    clock = Clock()
    queue = ShardQueue([0], lease_seconds=10, margin_seconds=4, clock=clock)
    lease = queue.acquire("w1")
    clock.now = 1
    fence = keeper(queue, lease, clock)  # asks at 1: may start writes until 7
    start = 1.0
    if renewed:
        clock.now = 3

        def slow_heartbeat(method: str, *args: Any) -> Any:
            clock.now += 2  # the reply comes at 5: the deadline counts from 3, not 5
            return getattr(queue, method)(*args)

        fence._call = slow_heartbeat
        assert fence.renew()
        fence._call = caller(queue)
        start = 3.0
    clock.now = start + 6 - 1e-9  # right before the deadline: a write may start
    assert fence.current()
    with fence.writing():
        clock.now = start + 6 + 3.9  # and run on to within the margin of the queue's expiry
    clock.now = start + 6  # the deadline itself: no write starts
    with pytest.raises(LeaseLost, match="not renewed within 6 s"):
        write(fence)
    assert not fence.current()


def test_a_write_in_flight_when_the_deadline_passes_keeps_the_window_open() -> None:
    clock = Clock()
    queue = ShardQueue([0], lease_seconds=10, margin_seconds=4, clock=clock)
    first = queue.acquire("hung")
    fence = keeper(queue, first, clock)
    with pytest.raises(OSError), fence.writing():  # started in time, failed (may land late)
        clock.now = 11  # meanwhile the lease expired
        raise OSError("PUT timed out")
    fence.__exit__(None, None, None)  # done with the lease: but a failed write is no "stopped"
    again = queue.acquire("next")
    assert again is not None and again.deferred
    assert queue.claim(again.lease_id).wait == pytest.approx(3.0)  # until 10 + 4


def test_a_holder_done_with_clean_writes_closes_its_window_at_once() -> None:
    clock = Clock()
    queue = ShardQueue([0], lease_seconds=10, margin_seconds=4, clock=clock)
    first = queue.acquire("w1")
    fence = keeper(queue, first, clock)
    write(fence)
    queue.release(first.lease_id, "server crashed")
    second = queue.acquire("w2")
    assert second.deferred, "its window is open until it says it stopped"
    queue.release(second.lease_id)
    queue.stopped(second.lease_id)
    fence.__exit__(None, None, None)  # every write it began returned: nothing more comes
    again = queue.acquire("w3")
    assert again is not None and not again.deferred
    assert queue.claim(again.lease_id) == Claim(True)


def test_the_tail_reissues_a_straggler_deferred_and_the_first_claim_wins() -> None:
    clock = Clock()
    queue = ShardQueue([0, 1, 2], lease_seconds=1000, margin_seconds=100, straggler_factor=2,
                       straggler_min_seconds=5, clock=clock)  # fmt: skip
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
    # The duplicate's claim wins and revokes the original, which may write until its expiry
    # (t=1000) + margin: the winner is told to wait that long, unless the original stops.
    assert queue.claim(dup.lease_id).wait == pytest.approx(1093.0)
    assert not queue.claim(slow.lease_id) and not queue.heartbeat(slow.lease_id)
    clock.now = 8
    queue.stopped(slow.lease_id)
    assert queue.claim(dup.lease_id) == Claim(True)
    assert not queue.complete(slow.lease_id, {})
    assert queue.complete(dup.lease_id, {"by": "fast"})
    status = queue.status()
    assert status.finished and status.summaries[slow.shard] == {"by": "fast"}


def test_a_duplicate_that_has_not_claimed_delays_nobody() -> None:
    """A deferred lease writes nothing before it wins a claim: the original holder claims
    without waiting for it, and it learns at its next heartbeat that it lost."""
    clock = Clock()
    queue = ShardQueue([0, 1], lease_seconds=1000, margin_seconds=100, straggler_min_seconds=0,
                       clock=clock)  # fmt: skip
    slow = queue.acquire("slow")
    finish(queue, "fast")
    clock.now = 1
    dup = queue.acquire("fast")
    assert dup is not None and dup.deferred and dup.shard == slow.shard
    assert queue.claim(slow.lease_id) == Claim(True, 0.0)
    assert not queue.heartbeat(dup.lease_id)
    assert queue.complete(slow.lease_id, {"by": "slow"})


def test_no_straggler_duplicate_while_shards_are_still_being_planned() -> None:
    """With the queue open, nothing pending means planning is behind, not the job's tail."""
    clock = Clock()
    queue = ShardQueue([0, 1], lease_seconds=1000, margin_seconds=100, straggler_min_seconds=0,
                       more_coming=True, clock=clock)  # fmt: skip
    slow = queue.acquire("slow")
    finish(queue, "fast")
    clock.now = 50
    assert queue.acquire("fast") is None
    queue.close()
    dup = queue.acquire("fast")
    assert dup is not None and dup.deferred and dup.shard == slow.shard


def test_a_revoked_loser_never_writes_after_the_winners_commit() -> None:
    """Both holders through their keepers; the loser keeps writing until its next heartbeat, and
    every write it makes happens before the winner's claim returns 0."""
    clock = Clock()
    queue = ShardQueue([0, 1], lease_seconds=10, margin_seconds=4, straggler_min_seconds=0,
                       clock=clock)  # fmt: skip
    events: list[tuple[float, str]] = []
    finish(queue, "other")
    loser_lease = queue.acquire("loser")  # shard 1
    loser = keeper(queue, loser_lease, clock)
    clock.now = 1
    winner = keeper(queue, queue.acquire("winner"), clock)
    assert winner.lease.deferred and winner.lease.shard == 1

    def loser_writes_while_it_can() -> None:
        while True:
            try:
                with loser.writing():
                    events.append((clock.now, "loser"))
            except LeaseLost:
                return
            clock.now += 0.5
            if clock.now % 2 == 0:
                loser.renew()  # refused once revoked: it learns it here

    # The winner claims at t=1: the loser (renewed at 0, expiry 10) may write until 6.
    winner._sleep = lambda s: (loser_writes_while_it_can(), setattr(clock, "now", clock.now + s))
    winner.claim_commit(timeout=100)
    events.append((clock.now, "winner commits"))
    loser_times = [t for t, who in events if who == "loser"]
    assert loser_times and max(loser_times) < events[-1][0]
    assert max(loser_times) < 2, "the loser stopped at its next heartbeat after the claim"
    with pytest.raises(LeaseLost):
        write(loser)


def test_a_claimant_never_waits_less_than_a_silent_former_holders_window() -> None:
    """A loser that never heartbeats again (partitioned) writes until its deadline: the winner
    is held until that lease's expiry + margin, past every write the loser could start."""
    clock = Clock()
    queue = ShardQueue([0], lease_seconds=10, margin_seconds=4, straggler_min_seconds=0,
                       clock=clock)  # fmt: skip
    slow_lease = queue.acquire("slow")
    slow = keeper(queue, slow_lease, clock)  # deadline 6
    queue._durations.append(0.0)  # a known shard time: the slow one counts as a straggler
    clock.now = 2
    winner = keeper(queue, queue.acquire("fast"), clock)
    assert queue.claim(winner.lease.lease_id).wait == pytest.approx(12.0)  # expiry 10 + margin 4
    clock.now = 5.9
    write(slow)  # it has not heard: its deadline (6) lets it start one more write, done by 10
    waited: list[float] = []
    winner._sleep = lambda s: (waited.append(s), setattr(clock, "now", clock.now + s))
    winner.claim_commit(timeout=100)
    assert clock.now == pytest.approx(14.0) and sum(waited) == pytest.approx(8.1)
    # A wait longer than the claimant's timeout: it gives up rather than commit over it.
    clock = Clock()
    queue = ShardQueue([0], lease_seconds=10, margin_seconds=4, straggler_min_seconds=0,
                       clock=clock)  # fmt: skip
    queue.acquire("slow")
    queue._durations.append(0.0)
    clock.now = 1
    with pytest.raises(TimeoutError, match="may still write"):
        keeper(queue, queue.acquire("fast"), clock).claim_commit(timeout=5)


def test_a_holder_that_expired_mid_write_and_then_died_fences_nobody_for_ever() -> None:
    clock = Clock()
    queue = ShardQueue([0], lease_seconds=10, margin_seconds=4, clock=clock)
    hung = queue.acquire("w1")
    assert hung is not None
    clock.now = 11  # expired (a write may be in flight): the next holder must wait for it
    again = queue.acquire("w2")
    assert again is not None and again.deferred
    assert queue.release_worker("w1") == []  # then its worker dies, holding no lease any more
    assert queue.claim(again.lease_id).wait == pytest.approx(3.0)
    clock.now = 14
    assert queue.claim(again.lease_id) == Claim(True), "its window ended: it fences nobody"
    queue.release(again.lease_id)
    queue.stopped(again.lease_id)
    assert not queue.acquire("w3").deferred


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
        queue.stopped(slow.lease_id)
        status = queue.status()
        assert not status.finished and status.failed == 0, "the duplicate may still finish it"
        if duplicate_succeeds:
            assert queue.claim(dup.lease_id) == Claim(True)
            assert queue.complete(dup.lease_id, {"by": "fast"})
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
    calls: list[str] = []

    def call(method: str, *args: Any) -> Any:
        calls.append(method)
        if method == "heartbeat" and len(calls) > 1:  # the first: the keeper's own renewal
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
    assert "stopped" not in calls, "the queue was unreachable: nothing to tell it"


def test_a_refused_heartbeat_loses_the_lease_and_tells_the_queue_it_stopped() -> None:
    queue = ShardQueue([0])
    lease = queue.acquire("w1")
    log: list[str] = []
    with LeaseKeeper(caller(queue, log), lease, interval=0.01) as keeper:
        queue.revoke(0)
        deadline = time.monotonic() + 10
        while "stopped" not in log:
            assert time.monotonic() < deadline, "no stopped notice"
            time.sleep(0.01)
        assert not keeper.current() and "refused the heartbeat" in keeper.lost_cause
    assert not queue.acquire("w2").deferred


def test_a_round_of_the_protocol_costs_no_call_per_write() -> None:
    clock = Clock()
    queue = ShardQueue([0], lease_seconds=10, margin_seconds=4, clock=clock)
    log: list[str] = []
    with keeper(queue, queue.acquire("w1"), clock, log) as fence:
        for _ in range(1000):
            write(fence)
        fence.claim_commit(timeout=1)
        write(fence)  # the commit marker
    assert queue.complete(fence.lease.lease_id, {})
    assert log == ["heartbeat", "claim"], "one renewal on start, one claim, nothing per write"


def test_shards_added_while_planning_are_served_and_the_queue_finishes_only_once_closed() -> None:
    queue = ShardQueue(more_coming=True)
    assert queue.acquire("w1") is None
    assert not queue.finished() and not queue.status().finished, "planning is still running"
    queue.add([3, 1])
    assert queue.status().total == 2 and not queue.status().closed
    assert finish(queue, "w1") == 3 and finish(queue, "w1") == 1
    assert not queue.finished(), "more may come"
    queue.add([0])
    with pytest.raises(ValueError, match="added twice"):
        queue.add([1])
    assert finish(queue, "w1") == 0
    queue.close()
    status = queue.status()
    assert status.closed and status.finished and status.total == 3 and queue.finished()
    with pytest.raises(ValueError, match="closed"):
        queue.add([5])


def test_a_queue_closed_from_the_start_is_finished_when_empty() -> None:
    assert ShardQueue([]).finished() and ShardQueue([]).status().closed
    assert not ShardQueue([0]).finished()
