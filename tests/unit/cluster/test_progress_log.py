"""The job log's progress lines: every one on a terminal; elsewhere one per interval and one on
every change of state, so a 10-hour job's log stays readable; the line a job ends on, once."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from cluster.config import parse_config
from cluster.driver import Driver, _Running
from cluster.progress_log import ProgressLog
from cluster.report import ProgressMeter
from cluster.shard_queue import QueueStatus

WORKING = (("working", 2),)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def polls(log: ProgressLog, clock: Clock, seconds: int, state=WORKING, committed: int = 0) -> None:
    """A poll every 2 s, as the driver's loop does, the state unchanged."""
    for _ in range(seconds // 2):
        clock.now += 2
        log.update(f"t={clock.now:.0f}", state, committed)


def test_off_a_terminal_a_steady_job_logs_once_per_interval() -> None:
    clock, said = Clock(), []
    log = ProgressLog(said.append, interval_s=30, live=False, clock=clock)
    polls(log, clock, 3600)  # an hour of polls
    assert len(said) == 120  # the first, then every 30 s: not 1,800
    assert said[:3] == ["t=2", "t=32", "t=62"]


def test_on_a_terminal_every_line_is_printed() -> None:
    clock, said = Clock(), []
    log = ProgressLog(said.append, interval_s=30, live=True, clock=clock)
    polls(log, clock, 60)
    assert len(said) == 30


def test_a_change_of_state_is_logged_at_once_an_unknown_one_is_not() -> None:
    clock, said = Clock(), []
    log = ProgressLog(said.append, interval_s=30, live=False, clock=clock)
    log.update("starting", (("starting", 2),), 0)
    clock.now = 4
    assert log.update("up", WORKING, 0)  # the workers are up: said at once
    clock.now = 6
    assert not log.update("same", WORKING, 0)
    clock.now = 8
    assert not log.update("unknown", None, 0)  # the workers' states could not be read
    clock.now = 10
    assert log.update("lost one", (("working", 1),), 0)  # a worker lost
    assert said == ["starting", "up", "lost one"]


def test_a_commit_after_a_quiet_spell_is_logged_steady_commits_are_not() -> None:
    clock, said = Clock(), []
    log = ProgressLog(said.append, interval_s=30, live=False, clock=clock)
    log.update("first", WORKING, 0)
    for committed in range(1, 10):  # a commit every 2 s: the interval rules
        clock.now += 2
        log.update(f"c{committed}", WORKING, committed)
    assert said == ["first"]
    clock.now += 40  # then nothing committed for 40 s (an interval's line in between)
    log.update("quiet", WORKING, 9)
    clock.now += 5
    assert log.update("after the quiet spell", WORKING, 10)
    assert said == ["first", "quiet", "after the quiet spell"]


class EndingJob(Driver):
    """The driver's loop over a job's last polls with Ray scripted: 6 shards, the queue
    finished from poll 2 on (as the loop reads it first; its progress read, after the
    workers', from poll `done_from`), worker k's run returned from poll `stops[k]` on (a
    server takes a few polls to stop)."""

    def __init__(self, stops: list[int], live: bool, said: list[str], done_from: int) -> None:
        raw = {"model": {"path": "m"}, "data": {"paths": ["d"]}, "store": {"url": "s"}}
        super().__init__(parse_config(raw), say=said.append, live=live)
        self.stops, self.poll, self.done_from = dict(enumerate(stops)), 0, done_from
        self.workers = {k: _Running("node", f"w{k}", None) for k in self.stops}

    def status(self) -> QueueStatus:
        self.poll += 1
        completed = 6 if self.poll >= 2 else 4
        return QueueStatus(pending=0, leased=6 - completed, completed=completed, failed=0, total=6)

    def wait(self, refs: list[Any], **_: Any) -> tuple[list[Any], list[Any]]:
        done = [ref for ref in refs if self.poll >= self.stops[ref]][:1]  # num_returns=1
        return done, [ref for ref in refs if ref not in done]

    def _start_missing_workers(self, queue: Any) -> None:
        pass

    def _stop_starting_workers(self) -> None:
        pass

    def _reap(self, ref: Any, queue: Any) -> None:
        del self.workers[ref]

    def _progress(self, meter: ProgressMeter, queue: Any) -> tuple[str, Any, int, bool]:
        done = 6 if self.poll >= self.done_from else 4
        line = f"{round(100 * done / 6)}% workers: {len(self.workers) or 'none'}"
        return line, ((("working", len(self.workers)),), False), done, done == 6


@pytest.mark.parametrize(
    ("stops", "live", "done_from"),
    [
        ([2], False, 2),  # one worker, stopped at once
        ([4], True, 2),  # its server takes polls to stop, on a terminal (every line offered)
        ([3, 5], False, 2),  # two workers stopping in turn: each stop a change of state
        # The last commit lands between the loop's queue read and its progress read: that
        # poll's line is already the last one.
        ([3], False, 1),
    ],
)
def test_the_line_a_job_ends_on_is_printed_once_not_again_as_each_worker_stops(
    monkeypatch: pytest.MonkeyPatch, stops: list[int], live: bool, done_from: int
) -> None:
    said: list[str] = []
    job = EndingJob(stops, live, said, done_from)
    queue = SimpleNamespace(status=SimpleNamespace(remote=job.status))
    monkeypatch.setattr("cluster.driver.ray.get", lambda status: status)
    monkeypatch.setattr("cluster.driver.ray.wait", job.wait)
    status = job._watch(queue, ProgressMeter(total_samples=23, total_tokens=0), None)
    assert status.finished
    first = [f"67% workers: {len(stops)}"] if done_from > 1 else []
    assert said == [*first, "100% workers: none"]
