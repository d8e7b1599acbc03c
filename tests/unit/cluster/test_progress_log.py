"""The job log's progress lines: every one on a terminal; elsewhere one per interval and one on
every change of state, so a 10-hour job's log stays readable."""

from __future__ import annotations

from cluster.progress_log import ProgressLog

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
