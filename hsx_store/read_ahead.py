"""Blocks of rows read ahead of the consumer: what the local and the object-storage readers share.

A sequential reader names its blocks in advance; each block's read is started as soon as the
blocks started but not yet handed out cost less than a byte budget (at least one block ahead),
and blocks are handed out in the order they were named. A block in hand was read while the
consumer worked on the previous one.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any, NamedTuple, Protocol

import numpy as np

Rows = dict[str, np.ndarray]


class Block(NamedTuple):
    """Rows [begin, end) of every array; `tag` is the caller's (handed back with the rows)."""

    begin: int
    end: int
    tag: Any = None


class PendingRows(Protocol):
    """A block's read under way (a `concurrent.futures.Future` is one)."""

    def result(self) -> Rows: ...

    def cancel(self) -> bool: ...


def read_ahead(
    blocks: Iterable[Block],
    start: Callable[[Block], tuple[PendingRows, int]],
    prefetch_bytes: int,
) -> Iterator[tuple[Block, Rows]]:
    """Each block with its rows, in order. `start(block)` begins a block's read and says what
    it costs (bytes it brings in); reads not yet handed out are cancelled when the caller stops
    early or a read fails."""
    ahead: deque[tuple[Block, PendingRows, int]] = deque()
    ahead_bytes = 0
    todo = iter(blocks)
    try:
        while True:
            for block in todo:
                pending, cost = start(block)
                ahead.append((block, pending, cost))
                ahead_bytes += cost
                if len(ahead) > 1 and ahead_bytes >= prefetch_bytes:
                    break
            if not ahead:
                return
            block, pending, cost = ahead.popleft()
            ahead_bytes -= cost
            rows = pending.result()
            yield block, rows
            del rows, pending  # the block's buffers are free once the caller lets go
    finally:
        for _, pending, _ in ahead:
            pending.cancel()
