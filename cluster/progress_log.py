"""Which progress lines reach the job log.

On a terminal every line is printed, the live view. Anywhere else (a `ray job submit` log, a
file) a line is printed when the job's state changes (a worker starts, is up or is lost;
planning ends; a shard commits after a quiet spell) and otherwise once every `interval_s`:
a 10-hour job logs ~1,200 lines, not one per poll. Once every shard is done the driver offers
no line while its workers stop, and `finish` prints the one the job ends on.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable


class ProgressLog:
    def __init__(
        self,
        say: Callable[[str], None],
        interval_s: float,
        live: bool,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.say, self.interval_s, self.live, self.clock = say, interval_s, live, clock
        self._printed_at: float | None = None
        self._state: Hashable = None
        self._committed = 0
        self._committed_at = clock()

    def update(self, line: str, state: Hashable, committed: int) -> bool:
        """Offer the current progress line. `state`: what is always worth a line when it changes
        (the workers' phases, planning; None: unknown this time, no change); `committed`: the
        shards committed so far. True when the line was printed."""
        now = self.clock()
        quiet_commit = committed > self._committed and now - self._committed_at >= self.interval_s
        if committed > self._committed:
            self._committed, self._committed_at = committed, now
        due = self._printed_at is None or now - self._printed_at >= self.interval_s
        changed = state is not None and state != self._state
        if state is not None:
            self._state = state
        if not (self.live or due or changed or quiet_commit):
            return False
        self._printed_at = now
        self.say(line)
        return True

    def finish(self, line: str) -> None:
        """The line the job ends on, once its workers have stopped: always printed."""
        self.say(line)
