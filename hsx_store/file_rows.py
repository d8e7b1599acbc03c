"""Rows of a store in a local directory: chunk files read straight into the caller's buffers,
several reads at a time, ahead of the consumer.

An uncompressed chunk file is the chunk's rows as they lie in memory, so a range of rows is one
`readinto` at an offset, with no intermediate buffer (zarr reads each chunk into a buffer, then
copies it out: ~0.3 of a plain read of the same files, benchmarks/reader_vs_raw_read.py). Every
chunk a block touches is one such read, run on a small thread pool, and the blocks after the
consumer's are read while it works. Measured here on 44 MB chunk files, 12 MB reads: cold from
disk, one read at a time 0.75 GB/s and four or eight at a time 1.2 GB/s (the disk serves
several requests at once); warm from the page cache 1.7 and 3.3 GB/s (the copies run on every
core). Other arrays (compressed, or chunked otherwise) are read through zarr, chunk by chunk, on
the same pool.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from pathlib import Path

import numpy as np
import zarr
from zarr.codecs import BytesCodec
from zarr.storage import LocalStore

from hsx_store.buffers import RecycledBuffers
from hsx_store.read_ahead import Block, PendingRows, Rows, read_ahead

READ_THREADS = 8  # reads in flight: cold, 2 to 16 read within noise of each other here
PREFETCH_BYTES = 128 << 20  # bytes of blocks read ahead of the consumer's


def _direct(array: zarr.Array) -> bool:
    """Whether a chunk file holds the chunk's whole rows as they lie in memory."""
    codecs = array.metadata.codecs
    return (
        isinstance(array.store, LocalStore)
        and len(codecs) == 1
        and isinstance(codecs[0], BytesCodec)
        and (codecs[0].endian is None or codecs[0].endian.value == sys.byteorder)
        and array.chunks[1:] == array.shape[1:]
    )


class _ArrayRows:
    """One array's rows: the reads that fill rows [begin, end) of `out`, one per chunk."""

    def __init__(self, array: zarr.Array) -> None:
        self.array, self.direct = array, _direct(array)
        self.root = Path(array.store.root) / array.path if self.direct else None
        self.rows = array.chunks[0]
        self.row_shape, self.dtype = array.shape[1:], array.dtype
        self.row_bytes = int(np.prod(self.row_shape, dtype=np.int64)) * array.dtype.itemsize
        self.buffers = RecycledBuffers(keep=16)  # the blocks ahead, the consumer's, its last

    def reads(self, begin: int, end: int, out: np.ndarray) -> Iterator[Callable[[], None]]:
        for k in range(begin // self.rows, -(-end // self.rows)):
            lo, hi = max(begin, k * self.rows), min(end, (k + 1) * self.rows)
            dst = out[lo - begin : hi - begin]
            if self.direct:
                yield partial(self._read_file, k, lo, dst)
            else:
                yield partial(self._read_zarr, lo, hi, dst)

    def _read_zarr(self, lo: int, hi: int, dst: np.ndarray) -> None:
        dst[...] = self.array[lo:hi]

    def _read_file(self, k: int, lo: int, dst: np.ndarray) -> None:
        zeros = (0,) * len(self.row_shape)
        path = self.root / self.array.metadata.encode_chunk_key((k, *zeros))
        try:
            with path.open("rb", buffering=0) as f:
                f.seek((lo - k * self.rows) * self.row_bytes)
                if f.readinto(memoryview(dst.reshape(-1).view(np.uint8))) != dst.nbytes:
                    raise OSError(f"{path}: chunk file shorter than its chunk")
        except FileNotFoundError:  # never written: the fill value, as zarr reads it
            dst[...] = self.array.metadata.fill_value


class _BlockRead:
    """A block's reads under way; its rows once every read is done."""

    def __init__(self, rows: Rows, reads: list[Future[None]]) -> None:
        self.rows, self.reads = rows, reads

    def result(self) -> Rows:
        for read in self.reads:
            read.result()
        return self.rows

    def cancel(self) -> bool:
        return all([read.cancel() for read in self.reads])


class FileRows:
    """Rows of several arrays chunked alike along their first axis, in a local directory (a
    RowSource, hsx_store/row_source.py).
    Memory while iterating `blocks`: the blocks read ahead (about `prefetch_bytes`, at least
    the next one) and the caller's. Buffers are taken in the caller's thread only."""

    def __init__(
        self,
        arrays: Mapping[str, zarr.Array],
        threads: int = READ_THREADS,
        prefetch_bytes: int = PREFETCH_BYTES,
    ) -> None:
        self.sources = {name: _ArrayRows(a) for name, a in arrays.items()}
        self.prefetch_bytes = prefetch_bytes
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="store-read")

    def read(self, begin: int, end: int) -> Rows:
        """Rows [begin, end) of every array, their chunks read at once."""
        return self._start(Block(begin, end))[0].result()

    def blocks(self, blocks: Iterable[Block]) -> Iterator[tuple[Block, Rows]]:
        """Each block with its rows, in order; later blocks are read while the caller works on
        earlier ones (at least one block ahead, more while within `prefetch_bytes`)."""
        return read_ahead(blocks, self._start, self.prefetch_bytes)

    def _start(self, block: Block) -> tuple[PendingRows, int]:
        n, rows, reads = block.end - block.begin, {}, []
        for name, source in self.sources.items():
            out = rows[name] = source.buffers.take((n, *source.row_shape), source.dtype)
            reads += [self._pool.submit(r) for r in source.reads(block.begin, block.end, out)]
        return _BlockRead(rows, reads), sum(out.nbytes for out in rows.values())
