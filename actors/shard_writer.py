"""Writes one leased work shard's hidden-state rows into the store (worker side).

The rules it keeps (store/format.py): whole chunks only, one writer per chunk, the commit marker
last, nothing written once the lease is lost. Every store write goes through the lease's write
fence (actors/lease_keeper.py); a deferred lease's chunks wait in a local spill directory until
its claim on the shard wins, and are written then.
"""

from __future__ import annotations

import json
import shutil
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import torch

from actors.lease_keeper import LeaseLost, Unfenced, WriteFence
from store.format import STATUS_FAILED, STATUS_PLANNED, STATUS_WRITTEN, Shard, Store


def _as_stored(x: np.ndarray | torch.Tensor, dtype: str, what: str) -> np.ndarray:
    """The array as stored: bf16 as its raw uint16 bits (bit-exact, NaN payloads included)."""
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


class _BufferPool:
    """Chunk assembly buffers kept for reuse across chunks and shards: writing into fresh
    pages costs a page fault per 4 KiB, measured here to slow the row copy ~5x."""

    def __init__(self, max_bytes: int = 1 << 29) -> None:
        self._free: list[tuple[np.ndarray, np.ndarray]] = []
        self._lock, self._max_bytes = threading.Lock(), max_bytes

    def get(
        self, shapes: tuple[tuple[int, ...], ...], dtype: type
    ) -> tuple[np.ndarray, np.ndarray]:
        with self._lock:
            for j, bufs in enumerate(self._free):
                if tuple(b.shape for b in bufs) == shapes and bufs[0].dtype == dtype:
                    return self._free.pop(j)
        aux, final = (np.empty(shape, dtype) for shape in shapes)
        return aux, final

    def put(self, bufs: tuple[np.ndarray, np.ndarray]) -> None:
        with self._lock:
            if sum(b.nbytes for pair in self._free for b in pair) < self._max_bytes:
                self._free.append(bufs)


_BUFFERS = _BufferPool()


def _when_all_done(futures: list[Future[None]], callback: Callable[[], None]) -> None:
    """Call `callback` once every future is done (or cancelled): at once if there are none."""
    if not futures:
        callback()
        return
    remaining, lock = [len(futures)], threading.Lock()

    def one_done(_: Future[None]) -> None:
        with lock:
            remaining[0] -= 1
            last = remaining[0] == 0
        if last:
            callback()

    for future in futures:
        future.add_done_callback(one_done)


class ShardWriter:
    """Writes one leased shard's rows. Whole chunks only: a chunk is encoded and written once,
    when every sample row it holds is in (padding and failed rows are zero), so zarr never
    read-modify-writes and no chunk has two writers. Chunks shared by several samples are
    assembled in reused buffers; a chunk one sample fills alone is written from that sample's
    memory. Writes run on a small thread pool (zstd and file I/O release the GIL); memory is
    bounded by the chunks still being assembled plus 2 * threads queued (write_sample waits).

    Every store write goes through `fence`; once the lease is lost nothing more is written and
    write_sample/mark_failed/commit raise LeaseLost. With `spill_dir` (a deferred lease) chunks
    go to local files first and reach the store only after `commit` has claimed the shard.
    `bytes_written` counts the sample payload bytes written (uncompressed, padding excluded);
    `seconds` the time callers spent blocked in this writer.
    """

    def __init__(
        self,
        store: Store,
        shard: Shard,
        threads: int = 2,
        fence: WriteFence | None = None,
        spill_dir: Path | None = None,
        fence_timeout: float = 600.0,
    ) -> None:
        m = store.manifest
        self.store, self.shard = store, shard
        self.fence = fence or Unfenced()
        self._spill, self._spilled = spill_dir, set()
        self._fence_timeout = fence_timeout
        if spill_dir is not None:
            spill_dir.mkdir(parents=True, exist_ok=True)
        self.bytes_written, self.seconds, self.chunk_seconds = 0, 0.0, 0.0
        # write_empty_chunks: skip zarr's all-zero scan of every chunk (it runs on zarr's one
        # event-loop thread, ~0.7 GB/s here, and serialised all writes); a rewrite then also
        # replaces every chunk of the range, all-zero ones included.
        self._aux, self._final = (
            store.group[name].with_config({"write_empty_chunks": True})
            for name in ("aux_hidden_states", "final_hidden_states")
        )
        self._c = m.chunk_tokens
        self._aux_shape, self._final_shape = (m.num_aux, m.hidden_size), (m.hidden_size,)
        self._shapes = ((self._c, *self._aux_shape), (self._c, *self._final_shape))
        self._np_dtype = np.uint16 if m.dtype == "bfloat16" else np.float32
        self._row_bytes = (m.num_aux + 1) * m.hidden_size * np.dtype(self._np_dtype).itemsize
        first = shard.token_begin // self._c
        # Rows each chunk still waits for (sample rows only: padding is never waited on) and
        # payload rows it holds (failed samples' rows excluded).
        self._waiting = {
            k: min(shard.token_end, (k + 1) * self._c) - max(shard.token_begin, k * self._c)
            for k in range(first, -(-shard.token_end // self._c))
        }
        self._payload = dict.fromkeys(self._waiting, 0)
        self._buffers: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._status = np.full(shard.sample_end - shard.sample_begin, STATUS_PLANNED, np.uint8)
        self._failed: dict[str, str] = {}
        self._ids = store.group["sample_id"][shard.sample_begin : shard.sample_end]
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
        aux: np.ndarray | torch.Tensor,
        final: np.ndarray | torch.Tensor,
        on_release: Callable[[], None] | None = None,
    ) -> None:
        """One sample's rows: aux [P, num_aux, H], final [P, H], P its planned length. Rows
        sharing a chunk with other samples are copied; chunks it fills alone are written from
        its memory, so the arrays must stay untouched until `on_release` is called (at once
        when nothing of theirs is pending, else once the last such chunk write is done)."""
        t0 = time.perf_counter()
        rows = self._claim(sample_index)
        p, name = rows.stop - rows.start, self._name(sample_index)
        aux = _as_stored(aux, self.store.manifest.dtype, f"sample {name} aux")
        final = _as_stored(final, self.store.manifest.dtype, f"sample {name} final")
        if aux.shape != (p, *self._aux_shape) or final.shape != (p, *self._final_shape):
            raise ValueError(
                f"sample {name}: got aux {tuple(aux.shape)} final {tuple(final.shape)}, "
                f"expected {p} rows: aux {(p, *self._aux_shape)} final {(p, *self._final_shape)}"
            )
        direct: list[Future[None]] = []
        for k, lo, hi in self._chunk_parts(rows):
            src = slice(lo - rows.start, hi - rows.start)
            self._payload[k] += hi - lo
            if hi - lo == self._c:  # a whole chunk of this sample: written from its own memory
                self._waiting[k] = 0
                direct.append(self._submit(k, aux[src], final[src]))
                continue
            buf_aux, buf_final = self._buffer(k)
            dst = slice(lo - k * self._c, hi - k * self._c)
            buf_aux[dst], buf_final[dst] = aux[src], final[src]
            self._arrived(k, hi - lo)
        self._status[sample_index - self.shard.sample_begin] = STATUS_WRITTEN
        if on_release is not None:
            _when_all_done(direct, on_release)
        self.seconds += time.perf_counter() - t0

    def mark_failed(self, sample_index: int, reason: str) -> None:
        """The sample's rows stay zero, its status is 2 and the reason goes in the summary."""
        rows = self._claim(sample_index)
        self._failed[str(self._ids[sample_index - self.shard.sample_begin])] = reason
        self._status[sample_index - self.shard.sample_begin] = STATUS_FAILED
        for k, lo, hi in self._chunk_parts(rows):
            dst = slice(lo - k * self._c, hi - k * self._c)
            for buf in self._buffer(k):
                buf[dst] = 0  # buffers are reused: zero what is not sample data
            self._arrived(k, hi - lo)

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
        self.fence.claim_commit(self._fence_timeout)  # first claim wins; others stop writing
        if self._spill is not None:
            self._flush_spill()
        sh, g = self.shard, self.store.group
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
        with self.fence.writing():
            g["sample_status"][sh.sample_begin : sh.sample_end] = self._status
            g["shard_summary"][sh.index] = json.dumps(stored)
            g["shard_committed"][sh.index] = 1  # the commit marker, last
        self._stopped = True
        self._drop_spill()
        self.seconds += time.perf_counter() - t0
        return stored

    def abort(self) -> None:
        """Stop: queued chunk writes are dropped, running ones finish, nothing more is written."""
        self._stopped = True
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._drop_spill()

    # -- internals ---------------------------------------------------------------------------

    def _name(self, i: int) -> str:
        return f"{i} ({self._ids[i - self.shard.sample_begin]})"

    def _raise_if_stopped(self) -> None:
        if self._lost:
            raise LeaseLost(f"shard {self.shard.index}: lease lost, nothing more is written")
        if self._stopped:
            raise RuntimeError(f"shard {self.shard.index}: writer already committed or aborted")
        for f in self._futures:
            if f.done() and f.exception() is not None:
                raise f.exception()  # type: ignore[misc]

    def _uncommit(self) -> None:
        """A re-issued shard is no longer complete while its rows are being overwritten."""
        if self.store.group["shard_committed"][self.shard.index]:
            with self.fence.writing():
                self.store.group["shard_committed"][self.shard.index] = 0

    def _flush_spill(self) -> None:
        """A deferred lease, its claim won: the spilled chunks go to the store now."""
        self._uncommit()
        for k in sorted(self._spilled):
            aux, final = (np.load(self._spill / f"{k}.{n}.npy", mmap_mode="r") for n in "af")
            with self.fence.writing():
                self._store_chunk(k, aux, final)

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

    def _buffer(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Chunk k's assembly buffers; every row gets sample data, or zero (failed, padding)."""
        if k not in self._buffers:
            bufs = _BUFFERS.get(self._shapes, self._np_dtype)
            for buf in bufs:  # padding rows, outside the shard's samples
                buf[: max(0, self.shard.token_begin - k * self._c)] = 0
                buf[max(0, self.shard.token_end - k * self._c) :] = 0
            self._buffers[k] = bufs
        return self._buffers[k]

    def _arrived(self, k: int, rows: int) -> None:
        """Rows of chunk k are in (copied, or failed and left zero); write it once complete."""
        self._waiting[k] -= rows
        if self._waiting[k] == 0:
            self._submit(k, *self._buffers.pop(k), recycle=True)

    def _submit(
        self, k: int, aux: np.ndarray, final: np.ndarray, recycle: bool = False
    ) -> Future[None]:
        self._slots.acquire()  # back-pressure: bounded chunks in flight
        future = self._pool.submit(self._write_chunk, k, aux, final, recycle)
        self._futures.append(future)
        return future

    def _write_chunk(self, k: int, aux: np.ndarray, final: np.ndarray, recycle: bool) -> None:
        try:
            if not self.fence.current():
                self._lost = True
            if self._stopped or self._lost:
                return
            if self._spill is not None:
                np.save(self._spill / f"{k}.a.npy", aux)
                np.save(self._spill / f"{k}.f.npy", final)
                self._spilled.add(k)
            else:
                with self.fence.writing():
                    self._store_chunk(k, aux, final)
            if recycle:
                _BUFFERS.put((aux, final))
        except LeaseLost:
            self._lost = True
        finally:
            self._slots.release()

    def _store_chunk(self, k: int, aux: np.ndarray, final: np.ndarray) -> None:
        t0 = time.perf_counter()
        rows = slice(k * self._c, (k + 1) * self._c)
        self._aux[rows] = aux
        self._final[rows] = final
        with self._lock:
            self.bytes_written += self._payload[k] * self._row_bytes
            self.chunk_seconds += time.perf_counter() - t0
