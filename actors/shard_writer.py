"""Writes one leased work shard's hidden-state rows into the store (worker side).

The rules it keeps (docs/store-format.md): whole chunks only, one writer per chunk, the commit
marker last, nothing written once the lease is lost. Every store write goes through the lease's
write fence (actors/lease_keeper.py); a deferred lease's chunks wait in a local spill directory
until its claim on the shard wins, and are written then. Design: docs/design/node-worker.md.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import torch
import zarr
from zarr.codecs import BytesCodec
from zarr.codecs.bytes import Endian
from zarr.storage import LocalStore

from actors.lease_keeper import LeaseLost, Unfenced, WriteFence
from hsx_store.format import (
    STATUS_FAILED,
    STATUS_PLANNED,
    STATUS_WRITTEN,
    Shard,
    Store,
    StoredArray,
    stored_arrays,
)
from hsx_store.fp8 import FP8_DTYPE, Fp8Rows, quantize_into
from hsx_store.location import SinglePutObjectStore, ThrottleTally


def _raw(x: np.ndarray | torch.Tensor | Fp8Rows, dtype: str, what: str) -> np.ndarray:
    """The array's values in `dtype` as numpy: bf16 as its raw uint16 bits (bit-exact, NaN
    payloads included)."""
    if isinstance(x, Fp8Rows):
        raise ValueError(f"{what}: FP8 rows, the store keeps {dtype}")
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu()
        if dtype == "bfloat16" and x.dtype == torch.bfloat16:
            return x.view(torch.int16).numpy().view(np.uint16)
        if dtype == "float32" and x.dtype == torch.float32:
            return x.numpy()
    elif dtype == "bfloat16" and x.dtype in (ml_dtypes.bfloat16, np.uint16):
        return x.view(np.uint16)
    elif dtype == "float32" and x.dtype == np.float32:
        return x
    # Never convert silently: a dtype other than the manifest's means the server is not the plan's.
    raise ValueError(f"{what}: dtype {x.dtype} does not match the store's {dtype}")


def _fp8_bits(rows: Fp8Rows, what: str) -> tuple[np.ndarray, np.ndarray]:
    """Rows the server quantized, as stored: e4m3 bits (uint8) and float32 scales, no copy."""
    values, scales = rows.values.detach().cpu(), rows.scales.detach().cpu()
    if values.dtype not in (torch.float8_e4m3fn, torch.uint8) or scales.dtype != torch.float32:
        raise ValueError(f"{what}: FP8 rows are {values.dtype} with {scales.dtype} scales")
    if tuple(scales.shape) != tuple(values.shape[:-1]):
        raise ValueError(f"{what}: scales {tuple(scales.shape)} for values {rows.shape}")
    return values.view(torch.uint8).numpy(), scales.numpy()


def _short(name: str) -> str:
    return name.removesuffix("_hidden_states")  # "aux", "final": as errors name them


class _BufferPool:
    """Chunk assembly buffers (one per stored array) kept for reuse across chunks and shards:
    writing into fresh pages costs a page fault per 4 KiB, measured here to slow the row copy
    ~5x."""

    def __init__(self, max_bytes: int = 1 << 29) -> None:
        self._free: list[tuple[np.ndarray, ...]] = []
        self._lock, self._max_bytes = threading.Lock(), max_bytes

    def get(self, layout: tuple[tuple[tuple[int, ...], np.dtype], ...]) -> tuple[np.ndarray, ...]:
        """Buffers of these (shape, dtype)s."""
        with self._lock:
            for j, bufs in enumerate(self._free):
                if tuple((b.shape, b.dtype) for b in bufs) == layout:
                    return self._free.pop(j)
        return tuple(np.empty(shape, dtype) for shape, dtype in layout)

    def put(self, bufs: tuple[np.ndarray, ...]) -> None:
        with self._lock:
            if sum(b.nbytes for group in self._free for b in group) < self._max_bytes:
                self._free.append(bufs)


_BUFFERS = _BufferPool()
_ZEROS = [np.zeros(0, np.uint8)]  # grown on demand; never written, so its pages stay shared


def _zeros(nbytes: int) -> memoryview:
    if _ZEROS[0].nbytes < nbytes:
        _ZEROS[0] = np.zeros(nbytes, np.uint8)
    return memoryview(_ZEROS[0])[:nbytes]


class _Loan:
    """A sample's memory lent to the chunks holding its rows: `on_release` runs once no chunk
    needs it any more (written, dropped, or its rows copied out)."""

    def __init__(self, nbytes: int, on_release: Callable[[], None] | None) -> None:
        self.nbytes, self._on_release = nbytes, on_release
        self.refs, self.unsent, self._lock = 1, 0, threading.Lock()  # 1: write_sample's own

    def drop(self, n: int = 1) -> None:
        with self._lock:
            self.refs -= n
            done = self.refs == 0
        if done and self._on_release is not None:
            self._on_release()


@dataclass(frozen=True)
class _Unquantized:
    """A piece of bf16 rows that an FP8 store quantizes before writing them: its sample (as
    errors name it) and the sample row its first row is."""

    sample: str
    first_row: int


@dataclass
class _Piece:
    """Rows [lo, lo + len) of a chunk, one array per stored array: views of a sample's memory
    (lent) or of a buffer. `unquantized`: the rows are instead one bf16 array per hidden array,
    which an FP8 store quantizes on the write thread as it writes them (_ChunkBytes), or into a
    chunk buffer (`_into_buffer`) where they are copied out or the whole chunk goes at once."""

    lo: int
    rows: tuple[np.ndarray, ...]
    loan: _Loan | None
    unquantized: _Unquantized | None = None

    def __len__(self) -> int:
        return len(self.rows[0])


# e4m3 bytes of bf16 rows quantized at once while a chunk streams into its file, in a buffer
# reused block after block. Measured here (fp8_writer_vs_bf16_writer's rows, the FP8 store's
# rate over the bf16 store's): 4 MiB 1.05, 1 MiB 1.00, 256 KiB 0.86 (each block costs a call
# and a write()), and 0.97 quantizing a whole sample's rows into a chunk buffer first.
QUANTIZE_BLOCK_BYTES = 4 << 20
_BLOCKS = threading.local()  # each write thread's block buffer, reused


def _block_buffer(nbytes: int) -> np.ndarray:
    if getattr(_BLOCKS, "buffer", None) is None or _BLOCKS.buffer.nbytes < nbytes:
        _BLOCKS.buffer = np.empty(nbytes, np.uint8)
    return _BLOCKS.buffer[:nbytes]


class _ChunkBytes:
    """A chunk's bytes of each stored array, in order, as views: its pieces, zeros where no row
    was written. Unquantized pieces (bf16 rows for an FP8 store) are quantized as their values
    are read, a block of rows at a time into the write thread's block buffer, each view valid
    until the next is asked for; their scales are kept for the scale array, read after."""

    def __init__(self, pieces: list[_Piece], stored: list[StoredArray], rows: int) -> None:
        self._pieces, self._stored, self._rows = sorted(pieces, key=lambda p: p.lo), stored, rows
        # The hidden arrays, if any piece is unquantized (its rows are one per hidden array)
        self._hidden = next((len(p.rows) for p in pieces if p.unquantized), 0)
        self._scales: dict[int, np.ndarray] = {}  # hidden array -> the chunk's scales

    def parts(self, which: int) -> Iterator[memoryview]:
        """Stored array `which`'s bytes; a scale array's after its values array's."""
        row_bytes, at = self._stored[which].row_bytes, 0
        for p in self._pieces:
            if p.lo > at:
                yield _zeros((p.lo - at) * row_bytes)
            if p.unquantized is None:
                yield memoryview(p.rows[which].reshape(-1).view(np.uint8))
            elif which < self._hidden:
                yield from self._quantized(p, which)
            else:
                rows = self._scales[which - self._hidden][p.lo : p.lo + len(p)]
                yield memoryview(rows.reshape(-1).view(np.uint8))
            at = p.lo + len(p)
        if at < self._rows:
            yield _zeros((self._rows - at) * row_bytes)

    def _quantized(self, piece: _Piece, which: int) -> Iterator[memoryview]:
        values, bf16 = self._stored[which], piece.rows[which]
        scales = self._scales.setdefault(
            which, np.empty((self._rows, *values.row_shape[:-1]), np.float32)
        )
        step = max(1, QUANTIZE_BLOCK_BYTES // values.row_bytes)
        for lo in range(0, len(piece), step):
            hi = min(lo + step, len(piece))
            out = _block_buffer((hi - lo) * values.row_bytes).reshape(hi - lo, *values.row_shape)
            bad = quantize_into(bf16[lo:hi], out, scales[piece.lo + lo : piece.lo + hi])
            if bad is not None:
                raise _non_finite(piece, values, lo, bad)
            yield memoryview(out.reshape(-1))


def _non_finite(piece: _Piece, values: StoredArray, lo: int, bad: int) -> ValueError:
    """The error for an unquantized piece's rows from `lo` holding an inf or NaN (in row `bad`
    of them, flat over the rows' leading dimensions)."""
    assert piece.unquantized is not None
    token, *rest = np.unravel_index(bad, (len(piece) - lo, *values.row_shape[:-1]))
    at = (int(token) + lo + piece.unquantized.first_row, *map(int, rest))
    return ValueError(
        f"{piece.unquantized.sample} {_short(values.name)}: non-finite value in row {at}; an "
        "FP8 store keeps finite values only"
    )


def _write_file(path: Path, parts: Iterable[memoryview], mode: int = 0o666) -> None:
    """Write `parts` as the file at `path`, each straight from its memory (the kernel copies it
    into the page cache: no assembled copy), atomically as zarr's LocalStore does: a temp file
    renamed over the key. One write() per part: writev() of the same parts measured ~3x slower
    here (median 1.3 vs 0.45 s a round of benchmarks/writer_vs_tofile.py). `mode`: before the
    umask (store files as zarr makes them; spill files private)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{uuid.uuid4().hex}.partial")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
        try:
            for part in parts:
                while part.nbytes:  # a short write: resume where it stopped
                    part = part[os.write(fd, part) :]
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _raw_chunk_put(array: zarr.Array, k: int) -> Callable[[Iterable[memoryview]], None] | None:
    """How to store chunk k of `array` from its rows' bytes in pieces, where its stored form is
    just those bytes (no codec but little-endian bytes, on a little-endian host): a local file
    written from each piece as it comes, or one PUT of them all. None where zarr must encode
    it."""
    store = array.store_path.store
    codecs = array.metadata.codecs
    raw = (
        sys.byteorder == "little"
        and len(codecs) == 1
        and isinstance(codecs[0], BytesCodec)
        and codecs[0].endian in (None, Endian.little)
    )
    key = (
        f"{array.store_path.path}/{array.metadata.encode_chunk_key((k,) + (0,) * (array.ndim - 1))}"
    )
    if raw and isinstance(store, LocalStore):
        store._check_writable()  # a store opened read-only refuses, as zarr's own write would
        return functools.partial(_write_file, Path(store.root) / key)
    if raw and isinstance(store, SinglePutObjectStore):
        return lambda parts: store.put_parts(key, list(parts))
    return None


class ShardWriter:
    """Writes one leased shard's rows. Whole chunks only: a chunk is written once, when every
    sample row it holds is in (padding and failed rows are zero), so zarr never
    read-modify-writes and no chunk has two writers. A chunk is written straight from the
    samples' memory (a local file: one write() per row range; object storage: one PUT of the
    ranges), never assembled in a copy first: on this 2-core machine the write is memory-bound
    and that copy cost ~half the throughput (benchmarks/writer_vs_tofile.py).
    Where zarr must encode (a codec) the chunk is assembled in a reused buffer on a write
    thread. Every stored array (hsx_store/format.py `stored_arrays`: the hidden arrays, and an FP8
    store's scales) is chunked alike, so a chunk index means the same rows in each.

    A sample's memory is lent to the chunks holding its rows until they are written, so a
    sample whose last chunk waits for the next sample stays held (its `on_release` comes
    later). Lent memory waiting on incomplete chunks is bounded by `max_lent_bytes`: beyond it,
    the oldest lent rows are copied into chunk buffers and their sample released (the capture
    ring counts unreleased dumps, and must not fill up with ones waiting for a neighbour that
    it cannot produce). Writes run on a small thread pool (file I/O releases the GIL); at most
    2 * threads chunks are queued (write_sample waits).

    Every store write goes through `fence`; once the lease is lost nothing more is written and
    write_sample/mark_failed/commit raise LeaseLost. With `spill_dir` (a deferred lease) chunks
    go to local files first and reach the store only after `commit` has claimed the shard.
    `bytes_written` counts the sample payload bytes written (uncompressed, padding excluded);
    `seconds` the time callers spent blocked in this writer; `throttled` the throttled answers
    (503 SlowDown) its chunk and sample_status PUTs were retried after (hsx_store/location.py).
    """

    def __init__(
        self,
        store: Store,
        shard: Shard,
        threads: int = 2,
        fence: WriteFence | None = None,
        spill_dir: Path | None = None,
        fence_timeout: float = 600.0,
        max_lent_bytes: int = 512 << 20,
    ) -> None:
        m = store.manifest
        self.store, self.shard = store, shard
        self.fence = fence or Unfenced()
        self._spill, self._spilled = spill_dir, set()
        self._fence_timeout = fence_timeout
        if spill_dir is not None:
            spill_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.bytes_written, self.seconds, self.chunk_seconds = 0, 0.0, 0.0
        self.throttled = ThrottleTally()
        # write_empty_chunks: skip zarr's all-zero scan of every chunk (it runs on zarr's one
        # event-loop thread, ~0.7 GB/s here, and serialised all writes); a rewrite then also
        # replaces every chunk of the range, all-zero ones included.
        self._stored: list[StoredArray] = stored_arrays(m)  # hidden arrays (+ FP8 scales)
        self._arrays = [
            store.array(a.name).with_config({"write_empty_chunks": True}) for a in self._stored
        ]
        # Local files are written a piece at a time: bf16 rows for an FP8 store are quantized
        # as their bytes are written. An object's one PUT takes the whole chunk, quantized first.
        self._streams = isinstance(self._arrays[0].store_path.store, LocalStore)
        self._c = m.chunk_tokens
        self._layout = tuple(((self._c, *a.row_shape), a.dtype) for a in self._stored)
        self._row_bytes = sum(a.row_bytes for a in self._stored)
        first = shard.token_begin // self._c
        # Rows each chunk still waits for (sample rows only: padding is never waited on) and
        # payload rows it holds (failed samples' rows excluded).
        self._waiting = {
            k: min(shard.token_end, (k + 1) * self._c) - max(shard.token_begin, k * self._c)
            for k in range(first, -(-shard.token_end // self._c))
        }
        self._payload = dict.fromkeys(self._waiting, 0)
        self._pieces: dict[int, list[_Piece]] = {}
        self._buffers: dict[int, tuple[np.ndarray, ...]] = {}
        self._lent: list[tuple[_Loan, list[int]]] = []  # oldest first: loans on unsent chunks
        self._max_lent = max_lent_bytes
        self._status = np.full(shard.sample_end - shard.sample_begin, STATUS_PLANNED, np.uint8)
        self._failed: dict[str, str] = {}
        self._ids = store.array("sample_id")[shard.sample_begin : shard.sample_end]
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix=f"shard{shard.index}-write")
        self._slots = threading.Semaphore(2 * threads)
        self._futures: list[Future[None]] = []
        self._lock = threading.Lock()
        self._lost = self._stopped = False
        self._started = time.perf_counter()
        if spill_dir is None:
            self._uncommit()

    def write_sample(
        self,
        sample_index: int,
        *states: np.ndarray | torch.Tensor | Fp8Rows,
        on_release: Callable[[], None] | None = None,
    ) -> None:
        """One sample's rows, one array per hidden array of the store in the manifest's
        `hidden_arrays` order: aux [P, num_aux, H], final (post-norm) [P, H] and, if the store
        keeps it, pre-norm [P, H]; P is its planned length, the dtype the served one. The rows
        are written from this memory, so the arrays must stay untouched until `on_release` is
        called: once every chunk holding its rows is written (or its rows were copied out). An
        FP8 store takes rows the server quantized (Fp8Rows) as they are; bf16 rows it quantizes
        on the write threads as it writes each chunk (hsx_store/fp8.py), where a non-finite
        value is a ValueError naming the sample that the next call (or `commit`) raises."""
        t0 = time.perf_counter()
        rows = self._claim(sample_index)
        p, name = rows.stop - rows.start, self._name(sample_index)
        names = self.store.manifest.hidden_arrays
        if len(states) != len(names):
            raise ValueError(
                f"sample {name}: got {len(states)} hidden arrays, the store holds "
                f"{len(names)} ({', '.join(names)})"
            )
        hidden = dict(zip(names, states, strict=True))
        stored, unquantized = self._as_stored(hidden, p, f"sample {name}")
        loan = _Loan(sum(x.nbytes for x in stored), on_release)
        chunks = self._chunk_parts(rows)
        loan.refs += len(chunks)
        loan.unsent = len(chunks)
        for k, lo, hi in chunks:
            src = slice(lo - rows.start, hi - rows.start)
            self._payload[k] += hi - lo
            piece = _Piece(lo - k * self._c, tuple(x[src] for x in stored), loan)
            if unquantized:
                piece.unquantized = _Unquantized(f"sample {name}", src.start)
            self._pieces.setdefault(k, []).append(piece)
            self._arrived(k, hi - lo)
        self._status[sample_index - self.shard.sample_begin] = STATUS_WRITTEN
        if loan.unsent:
            self._lent.append((loan, [k for k, _, _ in chunks]))
            self._limit_lent()
        loan.drop()  # write_sample's own reference
        self.seconds += time.perf_counter() - t0

    def mark_failed(self, sample_index: int, reason: str) -> None:
        """The sample's rows stay zero, its status is 2 and the reason goes in the summary."""
        rows = self._claim(sample_index)
        self._failed[str(self._ids[sample_index - self.shard.sample_begin])] = reason
        self._status[sample_index - self.shard.sample_begin] = STATUS_FAILED
        for k, lo, hi in self._chunk_parts(rows):
            self._pieces.setdefault(k, [])
            self._arrived(k, hi - lo)  # no piece: its rows are written as zeros

    def commit(self, summary: dict[str, Any]) -> dict[str, Any]:
        """Wait for every chunk, then write this shard's sample_status chunk, its summary and,
        last, its commit marker. Returns the summary as stored."""
        t0 = time.perf_counter()
        self._raise_if_stopped()
        missing = np.flatnonzero(self._status == STATUS_PLANNED) + self.shard.sample_begin
        if missing.size:
            raise ValueError(f"shard {self.shard.index}: samples {missing.tolist()} not written")
        self._pool.shutdown(wait=True)
        for f in self._futures:
            f.result()  # re-raise a failed chunk write
        self._raise_if_stopped()
        # First claim wins; then wait until no former holder of the shard can still write.
        self.fence.claim_commit(self._fence_timeout)
        if self._spill is not None:
            self._flush_spill()
        sh, array = self.shard, self.store.array
        stored = {
            **summary,
            "shard": sh.index,
            "samples": sh.sample_end - sh.sample_begin,
            "written": int((self._status == STATUS_WRITTEN).sum()),
            "failed": self._failed,
            "bytes_written": self.bytes_written,
            "writer_seconds": round(self.seconds, 4),
            "chunk_write_seconds": round(self.chunk_seconds, 4),
            "wall_seconds": round(time.perf_counter() - self._started, 4),
        }
        # One fenced block per store request: the time fence bounds each write by the margin
        # (cluster/shard_queue.py), so a block must not chain several.
        with self.fence.writing(), self.throttled.counting():
            array("sample_status")[sh.sample_begin : sh.sample_end] = self._status
        stored["throttled_requests"] = self.throttled.count  # so far: not this PUT's, the marker's
        with self.fence.writing():
            array("shard_summary")[sh.index] = json.dumps(stored)
        with self.fence.writing():
            array("shard_committed")[sh.index] = 1  # the commit marker, last
        self._stopped = True
        self._drop_spill()
        self.seconds += time.perf_counter() - t0
        return stored

    def abort(self) -> None:
        """Stop: queued chunk writes are dropped, running ones finish, nothing more is written;
        every sample's memory still lent is released."""
        self._stopped = True
        self._pool.shutdown(wait=True, cancel_futures=True)
        for pieces in self._pieces.values():  # incomplete chunks: never to be written
            self._release(pieces)
        self._pieces.clear()
        self._drop_spill()

    # -- internals ---------------------------------------------------------------------------

    def _as_stored(
        self, hidden: dict[str, np.ndarray | torch.Tensor | Fp8Rows], p: int, what: str
    ) -> tuple[list[np.ndarray], bool]:
        """A sample's hidden arrays, contiguous (each chunk's piece of them is one range of
        bytes), and whether they still need quantizing. As stored, in `self._stored` order,
        except for bf16 rows into an FP8 store: those are the hidden arrays' bf16 rows, which
        the write threads quantize (their scales follow them then)."""
        m = self.store.manifest
        wanted = {a.name: (p, *a.row_shape) for a in self._stored if a.name in hidden}
        got = {n: tuple(x.shape) for n, x in hidden.items()}
        if got != wanted:
            raise ValueError(f"{what}: got shapes {got}, expected {p} rows: {wanted}")
        server_quantized = [isinstance(x, Fp8Rows) for x in hidden.values()]
        if m.dtype == FP8_DTYPE and all(server_quantized):
            pairs = [_fp8_bits(hidden[n], f"{what} {_short(n)}") for n in wanted]
            return [bits for bits, _ in pairs] + [scales for _, scales in pairs], False
        if m.dtype == FP8_DTYPE and any(server_quantized):
            raise ValueError(f"{what}: some hidden arrays are FP8 rows and some are not")
        served = {n: _raw(x, m.served_dtype, f"{what} {_short(n)}") for n, x in hidden.items()}
        return [np.ascontiguousarray(served[n]) for n in wanted], m.dtype == FP8_DTYPE

    def _into_buffer(self, piece: _Piece, bufs: tuple[np.ndarray, ...]) -> _Loan | None:
        """Put the piece's rows in `bufs` (chunk buffers) at its rows, copied, or quantized
        where they are bf16 rows for an FP8 store, and point the piece at them; returns the
        loan the piece held (its sample's memory is no longer needed by it)."""
        dst = slice(piece.lo, piece.lo + len(piece))
        if piece.unquantized is None:
            for buf, rows in zip(bufs, piece.rows, strict=True):
                buf[dst] = rows
        else:
            n = len(piece.rows)  # the hidden arrays: their values, then their scales, in bufs
            for j, rows in enumerate(piece.rows):
                bad = quantize_into(rows, bufs[j][dst], bufs[n + j][dst])
                if bad is not None:
                    raise _non_finite(piece, self._stored[j], 0, bad)
        loan, piece.loan, piece.unquantized = piece.loan, None, None
        piece.rows = tuple(buf[dst] for buf in bufs)
        return loan

    def _quantize_into_buffers(
        self, pieces: list[_Piece], buffers: tuple[np.ndarray, ...] | None
    ) -> tuple[np.ndarray, ...] | None:
        """Quantize a chunk's bf16 pieces into its buffers (those its copied-out rows are in,
        else reused ones), releasing their samples; the chunk's buffers then."""
        if all(piece.unquantized is None for piece in pieces):
            return buffers
        bufs = buffers if buffers is not None else _BUFFERS.get(self._layout)
        for piece in pieces:
            if piece.unquantized is not None:
                loan = self._into_buffer(piece, bufs)
                if loan is not None:
                    loan.drop()
        return bufs

    def _name(self, i: int) -> str:
        return f"{i} ({self._ids[i - self.shard.sample_begin]})"

    def _raise_if_stopped(self) -> None:
        if self._lost:
            raise LeaseLost(
                f"shard {self.shard.index}: lease lost ({self.fence.lost_cause}), nothing more "
                "is written"
            )
        if self._stopped:
            raise RuntimeError(f"shard {self.shard.index}: writer already committed or aborted")
        for f in self._futures:
            if f.done() and f.exception() is not None:
                raise f.exception()  # type: ignore[misc]

    def _uncommit(self) -> None:
        """A re-issued shard is no longer complete while its rows are being overwritten."""
        if self.store.array("shard_committed")[self.shard.index]:
            with self.fence.writing():
                self.store.array("shard_committed")[self.shard.index] = 0

    def _spill_path(self, k: int, which: int) -> Path:
        assert self._spill is not None
        return self._spill / f"{k}.{self._stored[which].name}.bin"

    def _flush_spill(self) -> None:
        """A deferred lease, its claim won: the spilled chunks go to the store now."""
        self._uncommit()
        for k in sorted(self._spilled):
            rows = tuple(
                np.memmap(self._spill_path(k, j), dtype, "r", shape=shape)
                for j, (shape, dtype) in enumerate(self._layout)
            )
            with self.fence.writing(), self.throttled.counting():
                self._store_chunk(k, [_Piece(0, rows, None)])

    def _drop_spill(self) -> None:
        if self._spill is not None:
            shutil.rmtree(self._spill, ignore_errors=True)

    def _claim(self, i: int) -> slice:
        self._raise_if_stopped()
        if not self.shard.sample_begin <= i < self.shard.sample_end:
            raise ValueError(f"sample {i} is not in shard {self.shard}")
        if self._status[i - self.shard.sample_begin] != STATUS_PLANNED:
            raise ValueError(f"sample {self._name(i)} was already written or marked failed")
        return self.store.sample_rows(i)

    def _chunk_parts(self, rows: slice) -> list[tuple[int, int, int]]:
        """(chunk, first row, end row) of each chunk the rows fall in."""
        first, last = rows.start // self._c, (rows.stop - 1) // self._c
        return [
            (k, max(rows.start, k * self._c), min(rows.stop, (k + 1) * self._c))
            for k in range(first, last + 1)
        ]

    def _arrived(self, k: int, rows: int) -> None:
        """Rows of chunk k are in (lent, or failed and left zero); write it once complete."""
        self._waiting[k] -= rows
        if self._waiting[k] == 0:
            pieces = self._pieces.pop(k)
            for piece in pieces:
                if piece.loan is not None:
                    piece.loan.unsent -= 1
            self._submit(k, pieces, self._buffers.pop(k, None))

    def _limit_lent(self) -> None:
        """Copy the oldest lent rows still waiting on incomplete chunks into chunk buffers, and
        release their samples, until at most max_lent_bytes of samples are held that way."""
        self._lent = [(loan, ks) for loan, ks in self._lent if loan.unsent]
        held = sum(loan.nbytes for loan, _ in self._lent)
        while self._lent and held > self._max_lent:
            loan, ks = self._lent.pop(0)
            held -= loan.nbytes
            for k in ks:
                for piece in self._pieces.get(k, []):
                    if piece.loan is loan:
                        self._copy_out(k, piece)

    def _copy_out(self, k: int, piece: _Piece) -> None:
        if k not in self._buffers:
            self._buffers[k] = _BUFFERS.get(self._layout)
        loan = self._into_buffer(piece, self._buffers[k])
        assert loan is not None  # a lent piece
        loan.unsent -= 1
        loan.drop()

    @staticmethod
    def _release(pieces: list[_Piece]) -> None:
        for piece in pieces:
            if piece.loan is not None:
                piece.loan.drop()

    def _submit(
        self,
        k: int,
        pieces: list[_Piece],
        buffers: tuple[np.ndarray, ...] | None,
    ) -> None:
        self._slots.acquire()  # back-pressure: bounded chunks in flight
        future = self._pool.submit(self._write_chunk, k, pieces, buffers)
        # Released however the write ends: written, dropped, failed or cancelled by abort().
        future.add_done_callback(lambda _: self._release(pieces))
        self._futures.append(future)

    def _write_chunk(
        self, k: int, pieces: list[_Piece], buffers: tuple[np.ndarray, ...] | None
    ) -> None:
        try:
            if not self.fence.current():
                self._lost = True
            if self._stopped or self._lost:
                return
            if self._spill is not None:
                chunk = _ChunkBytes(pieces, self._stored, self._c)
                for j in range(len(self._stored)):
                    _write_file(self._spill_path(k, j), chunk.parts(j), mode=0o600)
                self._spilled.add(k)
            else:
                with self.fence.writing(), self.throttled.counting():
                    buffers = self._store_chunk(k, pieces, buffers)
            if buffers is not None:
                _BUFFERS.put(buffers)
        except LeaseLost:
            self._lost = True
        finally:
            self._slots.release()

    def _store_chunk(
        self, k: int, pieces: list[_Piece], buffers: tuple[np.ndarray, ...] | None = None
    ) -> tuple[np.ndarray, ...] | None:
        """Store chunk k from its pieces; returns the chunk buffers it then holds (`buffers`,
        or those its rows were quantized into), to be reused."""
        t0 = time.perf_counter()
        puts = [_raw_chunk_put(a, k) for a in self._arrays]
        if None in puts or not self._streams:  # the whole chunk at once: quantized first
            buffers = self._quantize_into_buffers(pieces, buffers)
        if None in puts:  # zarr encodes: hand it the chunk assembled in a reused buffer
            bufs = _BUFFERS.get(self._layout)
            rows = slice(k * self._c, (k + 1) * self._c)
            for array, assembled in zip(self._arrays, self._assembled(pieces, bufs), strict=True):
                array[rows] = assembled
            _BUFFERS.put(bufs)
        else:
            chunk = _ChunkBytes(pieces, self._stored, self._c)
            for j, put in enumerate(puts):
                put(chunk.parts(j))
        with self._lock:
            self.bytes_written += self._payload[k] * self._row_bytes
            self.chunk_seconds += time.perf_counter() - t0
        return buffers

    @staticmethod
    def _assembled(pieces: list[_Piece], bufs: tuple[np.ndarray, ...]) -> tuple[np.ndarray, ...]:
        """The chunk's rows in `bufs`, zero where none was written; a piece that is the whole
        chunk is used as it is."""
        if len(pieces) == 1 and len(pieces[0]) == len(bufs[0]):
            return pieces[0].rows
        at = 0
        for piece in sorted(pieces, key=lambda p: p.lo):
            for buf, rows_of in zip(bufs, piece.rows, strict=True):
                buf[at : piece.lo] = 0
                buf[piece.lo : piece.lo + len(rows_of)] = rows_of
            at = piece.lo + len(piece)
        for buf in bufs:
            buf[at:] = 0
        return bufs
