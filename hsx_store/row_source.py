"""The contract the reader holds its row backends to.

A backend serves rows of a store's token-major arrays, all chunked alike along their first
axis: a range at once, or blocks in the order they were named, read ahead of the caller. The
local directory's (hsx_store/file_rows.py `FileRows`) and object storage's
(hsx_store/object_rows.py `RemoteRows`) implement it; hsx_store/reader.py picks one by the
store's location and reads through this alone.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Protocol, runtime_checkable

from hsx_store.read_ahead import Block, Rows


@runtime_checkable
class RowSource(Protocol):
    def read(self, begin: int, end: int) -> Rows:
        """Rows [begin, end) of every array."""
        ...

    def blocks(self, blocks: Iterable[Block]) -> Iterator[tuple[Block, Rows]]:
        """Each block with its rows, in order; later blocks are read while the caller works
        on earlier ones."""
        ...
