"""Rows of a store on object storage: whole chunk objects fetched concurrently, ahead of use.

Through zarr, a reader's block is one `array[begin:end]` per array, one after the other, and
the consumer waits for each: the network idles while the consumer works and vice versa. Here the
sequential reader names its blocks in advance. The chunk objects they touch (of every
token-major array) are fetched on zarr's event loop, at most `concurrency` GETs at a time and
about `prefetch_bytes` of chunks ahead of the block the consumer has, and each block's rows are
copied out of its chunks into a recycled buffer as soon as they arrive. A chunk shared by
consecutive blocks is fetched once. Blocks come back in the order they were named.

An uncompressed chunk (codec "none", native byte order) is one plain GET: the object is the
chunk's raw rows. A compressed one is read through zarr's async read of that chunk (it
decodes). A chunk that does not exist (never written: all fill value) reads as the fill value,
as through zarr.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Iterable, Iterator, Mapping

import numpy as np
import obstore
import obstore.exceptions
import zarr
from zarr.codecs import BytesCodec
from zarr.core.sync import _get_loop, sync
from zarr.storage import ObjectStore

from hsx_store.buffers import RecycledBuffers
from hsx_store.read_ahead import Block, PendingRows, Rows, read_ahead

CONCURRENCY = 8  # chunk GETs in flight: past ~8, loopback S3 (moto) gained nothing more here
PREFETCH_BYTES = 256 << 20  # chunk bytes fetched ahead of the consumer's block

ChunkKey = tuple[str, int]  # (array name, chunk index along the rows)


def _raw_chunks(array: zarr.Array) -> bool:
    """Whether a chunk object is the chunk's rows as they lie in memory (no codec at all)."""
    codecs = array.metadata.codecs
    return (
        len(codecs) == 1
        and isinstance(codecs[0], BytesCodec)
        and (codecs[0].endian is None or codecs[0].endian.value == sys.byteorder)
    )


class _ChunkSource:
    """One array's chunks, each read whole: `fetch(k)` is chunk k's rows, or None where the
    chunk was never written."""

    def __init__(self, array: zarr.Array) -> None:
        if array.chunks[1:] != array.shape[1:]:
            raise ValueError(f"{array.path}: chunks must hold whole rows, got {array.chunks}")
        self.array, self.rows = array, array.chunks[0]
        self.row_shape, self.dtype = array.shape[1:], array.dtype
        self.chunk_bytes = (
            self.rows * int(np.prod(self.row_shape, dtype=np.int64)) * (array.dtype.itemsize)
        )
        self.raw = _raw_chunks(array) and isinstance(array.store, ObjectStore)
        self.fill_value = array.metadata.fill_value
        # Enough for every block ahead of the consumer, the consumer's and its previous one.
        self.buffers = RecycledBuffers(keep=32)

    def chunks(self, begin: int, end: int) -> range:
        return range(begin // self.rows, -(-end // self.rows))

    def key(self, k: int) -> str:
        zeros = (0,) * len(self.row_shape)
        return f"{self.array.path}/{self.array.metadata.encode_chunk_key((k, *zeros))}"

    async def fetch(self, k: int) -> np.ndarray | None:
        if not self.raw:  # zarr fetches and decodes; a missing chunk comes back as fill
            stop = min((k + 1) * self.rows, self.array.shape[0])
            return np.asarray(await self.array.async_array.getitem(slice(k * self.rows, stop)))
        try:
            result = await obstore.get_async(self.array.store.store, self.key(k))
            data = await result.bytes_async()
        except (FileNotFoundError, obstore.exceptions.NotFoundError):  # obstore raises either
            return None
        if len(data) != self.chunk_bytes:
            raise OSError(f"{self.key(k)}: {len(data)} bytes, a chunk is {self.chunk_bytes}")
        return np.frombuffer(data, self.dtype).reshape(self.rows, *self.row_shape)


class RemoteRows:
    """Rows of several arrays chunked alike along their first axis, read from object storage
    (a RowSource, hsx_store/row_source.py).
    Memory while iterating `blocks`: the chunks of the blocks fetched ahead (about
    `prefetch_bytes`, at least the next block's), those blocks' buffers, and the caller's."""

    def __init__(
        self,
        arrays: Mapping[str, zarr.Array],
        concurrency: int = CONCURRENCY,
        prefetch_bytes: int = PREFETCH_BYTES,
    ) -> None:
        self.sources = {name: _ChunkSource(a) for name, a in arrays.items()}
        self.concurrency, self.prefetch_bytes = concurrency, prefetch_bytes
        self._gets: asyncio.Semaphore | None = None  # made on the loop, on first use

    def read(self, begin: int, end: int) -> Rows:
        """Rows [begin, end) of every array, their chunks all fetched at once."""
        block = Block(begin, end)
        return sync(self._assemble(block, self._buffers(block), {}))

    def blocks(self, blocks: Iterable[Block]) -> Iterator[tuple[Block, Rows]]:
        """Each block with its rows, in order; later blocks are fetched while the caller works
        on earlier ones (at least one block ahead, more while within `prefetch_bytes`)."""
        loop = _get_loop()
        fetched: dict[ChunkKey, asyncio.Task[np.ndarray | None]] = {}  # used on the loop only
        last = set[ChunkKey]()

        def start(block: Block) -> tuple[PendingRows, int]:
            nonlocal last
            keys = self._keys(block)
            cost = sum(self.sources[name].chunk_bytes for name, _ in keys - last)
            last = keys
            coro = self._assemble(block, self._buffers(block), fetched)
            return asyncio.run_coroutine_threadsafe(coro, loop), cost

        try:
            yield from read_ahead(blocks, start, self.prefetch_bytes)
        finally:  # the caller stopped early or a read failed: nothing goes on fetching
            loop.call_soon_threadsafe(lambda: [task.cancel() for task in fetched.values()])

    def _keys(self, block: Block) -> set[ChunkKey]:
        return {
            (name, k) for name, s in self.sources.items() for k in s.chunks(block.begin, block.end)
        }

    def _buffers(self, block: Block) -> Rows:
        n = block.end - block.begin
        return {
            name: s.buffers.take((n, *s.row_shape), s.dtype) for name, s in self.sources.items()
        }

    async def _assemble(
        self, block: Block, out: Rows, fetched: dict[ChunkKey, asyncio.Task[np.ndarray | None]]
    ) -> Rows:
        """The block's rows into `out`. `fetched` holds the chunks of the previous block:
        blocks start in the order they were submitted, so a chunk the previous block shares
        with this one is taken from there, and the ones it does not are let go."""
        keys = self._keys(block)
        for key in fetched.keys() - keys:
            del fetched[key]
        for key in sorted(keys - fetched.keys()):
            fetched[key] = asyncio.ensure_future(self._fetch(*key))
        mine = {key: fetched[key] for key in keys}
        for (name, k), task in sorted(mine.items()):
            source, chunk = self.sources[name], await task
            lo, hi = max(block.begin, k * source.rows), min(block.end, (k + 1) * source.rows)
            dst = out[name][lo - block.begin : hi - block.begin]
            if chunk is None:
                dst[...] = source.fill_value
            else:
                dst[...] = chunk[lo - k * source.rows : hi - k * source.rows]
        return out

    async def _fetch(self, name: str, k: int) -> np.ndarray | None:
        if self._gets is None:
            self._gets = asyncio.Semaphore(self.concurrency)
        async with self._gets:
            return await self.sources[name].fetch(k)
