"""Capture dump writer: publish per-request hidden-state dumps without blocking the forward.

A dump (its layout and the consumer's API: ``patches/dump_files.py``) is built in
``root/.tmp-<name>`` and published with one ``os.rename``, so a reader never sees a partial dump.
The host memory and files behind it come from ``patches/host_regions.py``.

With CUDA, a ring of *regions*: files under ``root/.ring/``, mapped and registered with
``cudaHostRegister`` once; ``fill()`` copies device rows straight into a region (side stream,
no host copy), publishing moves the file into the dump dir, and ``release_dump`` renames it
back so the region is reused (a dump deleted instead leaks its region: replaced, with a
warning). Without CUDA, or where registering a mapping on ``root`` fails, a staging buffer and
a multi-threaded copy into a plain file. Must not import sglang: benchmarks and tests load it.

Design, measurements, and why regions are not unregistered per dump:
docs/design/capture-plugin.md.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from patches.dump_files import (
    ALIGN,
    POOL_PREFIX,
    RING_DIR,
    RING_WRITERS,
    TMP_PREFIX,
    TensorSpecs,
    layout,
    ring_file_size,
)
from patches.host_regions import PreallocatedFile, Region, can_register_files_in, copy_to_file

log = logging.getLogger(__name__)

_MIN_REGION = 64 << 20  # smallest region made (unless max_pending_bytes is smaller)


def _size_class(n: int, floor: int) -> int:
    """Region sizes come in few classes (2**k and 1.5 * 2**k), so growth adds few regions."""
    n = max(n, floor)
    k = 1 << (n - 1).bit_length()
    return -(-(k * 3 // 4 if k * 3 // 4 >= n else k) // ALIGN) * ALIGN


class PendingDump:
    """One dump being filled. Views are valid until ``publish()``/``abort()``."""

    def __init__(
        self,
        writer: DumpWriter,
        name: str,
        file: PreallocatedFile | None,
        header: bytes,
        spans: dict[str, tuple[int, int]],
        tensors: TensorSpecs,
        meta: dict,
        nbytes: int,
        seq: int,
        region: Region | None = None,
    ) -> None:
        self.seq = seq
        self.path = writer.root / name
        self.tmp = writer.root / f".tmp-{name}"
        self.nbytes = nbytes  # file size (a ring dump: the region's capacity)
        self.meta = meta
        self.specs = tensors
        self._writer = writer
        self._file = file
        self._region = region
        self._events: list[torch.cuda.Event] = []
        self._state = "open"  # -> "published" | "aborted"
        if region is not None:
            # The region is registered: the DMA lands in the dump itself.
            self._staging: torch.Tensor | None = None
            assert region.buf is not None
            raw = region.buf
        else:
            # Pinned memory comes from torch's caching host allocator: after the first dumps of
            # a size, taking a buffer is a free-list lookup, not a cudaHostAlloc.
            self._staging = torch.empty(nbytes, dtype=torch.uint8, pin_memory=writer.pin)
            raw = self._staging
        raw[: len(header)].copy_(torch.frombuffer(bytearray(header), dtype=torch.uint8))
        self.views: dict[str, torch.Tensor] = {
            k: raw[spans[k][0] : spans[k][1]].view(dtype).view(shape)
            for k, (shape, dtype) in tensors.items()
        }
        self._views = self.views
        # Reused buffers hold old bytes: rows that fill() never covered are zeroed at publish
        # (off the forward thread) instead of zeroing every buffer up front.
        self._filled = {
            k: torch.zeros(v.shape[0] if v.dim() else 1, dtype=torch.bool)
            for k, v in self.views.items()
        }

    def fill(self, key: str, row_start: int, src: torch.Tensor) -> None:
        """Copy ``src`` into rows ``[row_start, row_start + len(src))`` of ``views[key]``.

        A CUDA source is copied on a side stream that first waits for the current stream, so the
        rows are complete when the copy starts and the forward stream never waits for the copy.
        """
        self.fill_converted((key,), row_start, src, lambda rows: (rows,))

    def fill_converted(
        self,
        keys: tuple[str, ...],
        row_start: int,
        src: torch.Tensor,
        convert: Callable[[torch.Tensor], tuple[torch.Tensor, ...]],
    ) -> None:
        """Fill rows ``[row_start, row_start + len(src))`` of ``views[k]`` for each of ``keys``
        with ``convert(src)`` (e.g. FP8 values and their scales). A CUDA source is converted on
        the side stream too: the forward stream never waits, and only converted bytes cross to
        the host. ``convert`` must not synchronize with the host."""
        if self._state != "open":
            raise RuntimeError(f"fill() on a {self._state} dump")
        rows = slice(row_start, row_start + src.shape[0])
        dsts = [self.views[k][rows] for k in keys]
        cuda = src.device.type == "cuda"
        if cuda:
            if not self._writer.pin:
                self._writer._warn_unpinned()
            side = self._writer._side_stream(src.device)
            side.wait_stream(torch.cuda.current_stream(src.device))
        with torch.cuda.stream(side) if cuda else contextlib.nullcontext():
            outs = convert(src)
            for key, dst, out in zip(keys, dsts, outs, strict=True):
                if dst.shape != out.shape or dst.dtype != out.dtype:
                    raise ValueError(
                        f"{key}: rows from {row_start}: {tuple(dst.shape)} {dst.dtype} "
                        f"<- {tuple(out.shape)} {out.dtype}"
                    )
            for key, dst, out in zip(keys, dsts, outs, strict=True):
                self._filled[key][rows] = True
                dst.copy_(out, non_blocking=cuda)
            if cuda:
                ev = torch.cuda.Event(blocking=True)  # the publisher sleeps, not spins, on it
                ev.record(side)
        if cuda:
            # The caching allocator must not reuse src before the side stream is done with it;
            # convert's outputs were allocated on the side stream, which orders their reuse.
            src.record_stream(side)
            self._events.append(ev)

    def publish(self, extra_meta: dict | None = None) -> None:
        """Hand the dump to the background thread, which makes it visible at ``path`` atomically."""
        if self._state != "open":
            raise RuntimeError(f"publish() on a {self._state} dump")
        self._state = "published"
        if extra_meta:
            self.meta = self.meta | extra_meta
        self.views = {}
        self._writer._submit(self)

    def abort(self) -> None:
        """Discard the dump: its bytes are freed and its tmp dir removed in the background."""
        if self._state != "open":
            raise RuntimeError(f"abort() on a {self._state} dump")
        self._state = "aborted"
        self.views = {}
        self._writer._submit(self)

    def _finish(self) -> None:
        """Runs on the publisher thread."""
        for ev in self._events:
            ev.synchronize()  # releases the GIL while the DMA finishes
        self._events = []
        staging, self._staging = self._staging, None
        if self._state == "aborted":
            self._views = {}
            if self._region is not None:
                self._writer._return_region(self._region)
                shutil.rmtree(self.tmp, ignore_errors=True)
            else:
                assert self._file is not None
                self._file.discard()
            return
        for k, filled in self._filled.items():
            # A key never passed to fill() was written through its view: leave it alone.
            if filled.any() and not filled.all():
                log.warning("DumpWriter: %s: %s has unfilled rows, zeroed", self.path, k)
                v = self._views[k]
                (v.view(1, *v.shape) if v.dim() == 0 else v)[~filled] = 0
        self._views = {}
        if self._region is None:
            assert self._file is not None and staging is not None
            path = self.tmp / "tensors.safetensors"
            if self._file.capacity > self.nbytes:
                os.truncate(path, self.nbytes)
            copy_to_file(path, staging, self._writer._workers, self._writer._copy_threads)
        meta = dict(self.meta)
        meta["tensors"] = {
            k: {"shape": list(shape), "dtype": str(dtype).removeprefix("torch.")}
            for k, (shape, dtype) in self.specs.items()
        }
        # 0600 like the tensors, also where the process's umask would let others read it
        fd = os.open(self.tmp / "meta.json", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(meta))
        if self._region is not None:
            self._writer._published(self._region, self.path / "tensors.safetensors")
        os.rename(self.tmp, self.path)


class DumpWriter:
    """Publishes dumps under ``root`` from background threads. One writer per ``root``.

    ``max_pending_bytes`` bounds the memory the dumps hold, and ``open()`` blocks beyond it
    (nothing is dropped; a dump larger than the bound still proceeds once it is alone):

    - ring (CUDA, root on tmpfs): the pinned regions together, i.e. dumps opened and not yet
      published *plus dumps published and not yet released* with ``release_dump``. A consumer that
      never releases eventually stalls ``open()``. ``pending_bytes`` is the capacity of the
      regions in use. Regions come in size classes (2**k, 1.5 * 2**k; at least 64 MiB or
      ``max_pending_bytes``) sized to the largest dump seen; when a dump outgrows every region a
      bigger one is added even past the bound, and outgrown regions keep serving smaller dumps
      until ``close()`` (never unregistered mid-run).
    - otherwise: dumps opened and not yet published (published dumps are plain files).

    ``device``: the CUDA device whose tensors will be dumped (default: the current one when CUDA is
    available). ``ring``: use registered regions (default: when ``device`` is CUDA; falls back
    with a warning if ``root`` cannot be registered). ``pool``: regions (or, without the ring,
    files) kept free ahead, made by ``pool_threads`` threads, as large as the largest dump seen
    or, from the start, ``region_bytes`` (tensor bytes of the largest dump expected; a header page
    is added): pass it to make the regions at construction rather than on the first dumps'
    forward thread (each 470 MB region takes ~0.15 s: allocate, populate, register).
    ``copy_threads``: threads populating a region's pages, or (no ring) copying a staged dump into
    its file. ``scan_interval``: how often the ring looks for released regions while dumps are
    out (releases made in this process are seen at once)."""

    def __init__(
        self,
        root: Path,
        max_pending_bytes: int = 2 << 30,
        *,
        device: torch.device | int | str | None = None,
        pool: int = 2,
        pool_threads: int = 2,
        copy_threads: int = 8,
        region_bytes: int = 0,
        ring: bool | None = None,
        scan_interval: float = 0.005,
    ) -> None:
        self.root = Path(root)
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)  # prompts' activations: private
        self.max_pending_bytes = max_pending_bytes
        if device is None and torch.cuda.is_available():
            device = torch.cuda.current_device()
        if isinstance(device, int):
            device = torch.device("cuda", device)
        self.device = torch.device(device) if device is not None else None
        self.pin = self.device is not None and self.device.type == "cuda"
        self._pool_size = max(pool, 0)
        # region_bytes counts tensor bytes: a dump's file also holds a header (one page, mostly)
        self._region_bytes = -(-region_bytes // ALIGN) * ALIGN + ALIGN if region_bytes else 0
        self._cv = threading.Condition()
        self._queue: deque[PendingDump] = deque()
        self._ready: list[PreallocatedFile] = []
        self._making = 0  # files/regions being made by pool threads
        self._wanted = 0  # open() calls waiting for a file
        self._outstanding: set[int] = set()  # seq of opened, not yet finished dumps
        self._seq = 0
        self._seq_file = 0
        self._pending = 0
        self._error: BaseException | None = None
        self._closed = False
        self._streams: dict[int, torch.cuda.Stream] = {}
        self._warned_unpinned = False
        self._copy_threads = max(copy_threads, 1)
        self._workers = ThreadPoolExecutor(self._copy_threads, "dump-writer-copy")
        # ring state (all under self._cv)
        self._ring_dir = self.root / RING_DIR
        shutil.rmtree(self._ring_dir, ignore_errors=True)  # a dead writer's regions
        self._ring = bool(self.pin if ring is None else ring) and self._probe_ring()
        self._regions: dict[int, Region] = {}  # by inode: live, in use and leaked
        self._free: list[Region] = []
        self._making_sizes: list[int] = []
        self._needs: list[int] = []  # sizes open() calls wait for
        self._reclaim: list[Region] = []
        self._floor = max(min(_MIN_REGION, -(-max_pending_bytes // ALIGN) * ALIGN), ALIGN)
        self._class = self._region_bytes if self._ring else 0
        self.leaked_bytes = 0
        self.released = 0  # regions seen back from consumers
        self._warned_leak = False
        self._interval = scan_interval
        self._threads = [threading.Thread(target=self._publisher, name="dump-writer", daemon=True)]
        self._threads += [
            threading.Thread(target=self._pooler, name=f"dump-writer-pool{i}", daemon=True)
            for i in range(max(pool_threads, 1))
        ]
        if self._ring:
            self._threads.append(
                threading.Thread(target=self._scanner, name="dump-writer-scan", daemon=True)
            )
            RING_WRITERS.add(self)
        for t in self._threads:
            t.start()
        if self.pin and self._region_bytes and not self._ring:
            # Pin the staging buffers once, now, rather than on the first dumps' forward thread.
            k = max(1, min(4, max_pending_bytes // self._region_bytes))
            bufs = [
                torch.empty(self._region_bytes, dtype=torch.uint8, pin_memory=True)
                for _ in range(k)
            ]
            del bufs

    @property
    def pending_bytes(self) -> int:
        return self._pending

    @property
    def ring(self) -> bool:
        """Whether dumps land in registered, recycled regions."""
        return self._ring

    def ring_stats(self) -> dict[str, int]:
        with self._cv:
            live = [r for r in self._regions.values() if r.state != "leaked"]
            return {
                "regions": len(live),
                "free": len(self._free),
                "bytes": sum(r.capacity for r in live),
                "leaked_bytes": self.leaked_bytes,
                "released": self.released,
            }

    # -- forward-thread API ---------------------------------------------------------------------
    def open(
        self,
        name: str,
        tensors: TensorSpecs,
        meta: dict,
    ) -> PendingDump:
        if not name or "/" in name or name.startswith("."):
            raise ValueError(f"bad dump name {name!r}")
        if (self.root / name).exists() or (self.root / f".tmp-{name}").exists():
            raise FileExistsError(self.root / name)
        tensors = {k: (tuple(s), d) for k, (s, d) in tensors.items()}
        if self._ring:
            return self._open_region(name, tensors, meta)
        header, spans = layout(tensors)
        nbytes = max([len(header), *(e for _, e in spans.values())])
        with self._cv:
            self._raise_error()
            # Back-pressure; a dump larger than the bound still proceeds once it is alone.
            while self._pending and self._pending + nbytes > self.max_pending_bytes:
                self._cv.wait()
                self._raise_error()
            if self._closed:
                raise RuntimeError("DumpWriter is closed")
            self._region_bytes = max(self._region_bytes, -(-nbytes // ALIGN) * ALIGN)
            self._wanted += 1
            try:
                while True:  # files come from the pool threads; wait if none fits yet
                    fits = [f for f in self._ready if f.capacity >= nbytes]
                    if fits:
                        file = min(fits, key=lambda f: f.capacity)
                        self._ready.remove(file)
                        break
                    self._cv.notify_all()
                    self._cv.wait()
                    self._raise_error()
            finally:
                self._wanted -= 1
                self._cv.notify_all()  # pool threads refill
            self._pending += nbytes
            self._seq += 1
            seq = self._seq
            self._outstanding.add(seq)
        tmp = self.root / f"{TMP_PREFIX}{name}"
        try:
            os.rename(file.dir, tmp)
            file.dir = tmp
            return PendingDump(self, name, file, header, spans, tensors, dict(meta), nbytes, seq)
        except BaseException:
            file.discard()
            self._done(seq, nbytes)
            raise

    def _open_region(self, name: str, tensors: TensorSpecs, meta: dict) -> PendingDump:
        need = ring_file_size(tensors)
        with self._cv:
            self._raise_error()
            if self._closed:
                raise RuntimeError("DumpWriter is closed")
            if need > self._class:
                self._class = _size_class(need, self._floor)
            self._needs.append(need)
            self._cv.notify_all()
            waited, warned = time.monotonic(), False
            try:
                while True:
                    region = self._take_free(need)
                    if region is None:
                        self._scan_locked()
                        region = self._take_free(need)
                    if region is not None:
                        break
                    self._cv.wait(0.002)
                    self._raise_error()
                    if self._closed:
                        raise RuntimeError("DumpWriter is closed")
                    if not warned and time.monotonic() - waited > 30:
                        warned = True
                        log.warning(
                            "DumpWriter: open(%s) has waited 30 s for a free region: are "
                            "consumers calling release_dump()? (%s)",
                            name,
                            self.ring_stats(),
                        )
            finally:
                self._needs.remove(need)
                self._cv.notify_all()
            region.state = "open"
            self._pending += region.capacity
            self._seq += 1
            seq = self._seq
            self._outstanding.add(seq)
        tmp = self.root / f"{TMP_PREFIX}{name}"
        try:
            tmp.mkdir(mode=0o700)
            dst = tmp / "tensors.safetensors"
            os.rename(region.path, dst)
            region.path = dst
            header, spans = layout(tensors, region.capacity)
            return PendingDump(
                self, name, None, header, spans, tensors, dict(meta), region.capacity, seq, region
            )
        except BaseException:
            self._return_region(region)
            shutil.rmtree(tmp, ignore_errors=True)
            self._done(seq, 0)
            raise

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every dump opened so far is published or aborted."""
        with self._cv:
            upto = self._seq
            ok = self._cv.wait_for(
                lambda: self._error is not None or not any(s <= upto for s in self._outstanding),
                timeout,
            )
            self._raise_error()
            if not ok:
                raise TimeoutError(f"{len(self._outstanding)} dumps still pending after {timeout}s")

    def close(self, timeout: float | None = None) -> None:
        """Flush, stop the threads, and give the ring back: free regions are deleted, published
        ones stay readable as plain files (``release_dump`` then deletes them)."""
        try:
            self.flush(timeout)
        finally:
            with self._cv:
                self._closed = True
                self._cv.notify_all()
            for t in self._threads:
                t.join(timeout)
            for f in self._ready:
                f.discard()
            self._ready = []
            if self._ring:
                RING_WRITERS.discard(self)
                with self._cv:
                    self._scan_locked()
                    regions = [*self._regions.values(), *self._reclaim]
                    self._regions, self._free, self._reclaim = {}, [], []
                    self._ring = False  # later scans and releases see no ring
                for r in regions:
                    r.destroy(unlink=r.state in ("free", "new"))
                shutil.rmtree(self._ring_dir, ignore_errors=True)
            self._workers.shutdown()

    # -- internals ------------------------------------------------------------------------------
    def _side_stream(self, device: torch.device) -> torch.cuda.Stream:
        idx = device.index if device.index is not None else torch.cuda.current_device()
        s = self._streams.get(idx)
        if s is None:
            s = self._streams[idx] = torch.cuda.Stream(device=idx)
        return s

    def _warn_unpinned(self) -> None:
        if not self._warned_unpinned:
            self._warned_unpinned = True
            log.warning(
                "DumpWriter: CUDA fill into unpinned memory; the copy blocks the forward thread"
            )

    def _raise_error(self) -> None:
        if self._error is not None:
            err, self._error = self._error, None
            raise RuntimeError("DumpWriter background thread failed") from err

    def _submit(self, pd: PendingDump) -> None:
        with self._cv:
            self._queue.append(pd)
            self._cv.notify_all()

    def _done(self, seq: int, nbytes: int) -> None:
        with self._cv:
            self._pending -= nbytes
            self._outstanding.discard(seq)
            self._cv.notify_all()

    def _publisher(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._queue or self._closed)
                if not self._queue:
                    return
                pd = self._queue.popleft()
            try:
                pd._finish()
            except BaseException as e:  # surfaced via flush/open
                log.exception("DumpWriter: publishing %s failed", pd.path)
                pd._staging = None
                if pd._region is not None:
                    self._recover_region(pd)
                shutil.rmtree(pd.tmp, ignore_errors=True)
                with self._cv:
                    self._error = self._error or e
            finally:
                # A ring dump keeps its bytes until released (or returned on abort/error).
                self._done(pd.seq, 0 if pd._region is not None else pd.nbytes)

    # -- ring -----------------------------------------------------------------------------------
    def _probe_ring(self) -> bool:
        """Use the ring only if files on root can be registered; otherwise warn and fall back."""
        try:
            self._ring_dir.mkdir(mode=0o700)
            ok = can_register_files_in(self._ring_dir)
        except Exception:  # e.g. no CUDA at all
            log.exception("DumpWriter: probing %s", self._ring_dir)
            ok = False
        if not ok:
            log.warning(
                "DumpWriter: cannot register mappings of files on %s (not tmpfs?): using a "
                "pinned staging buffer and a host copy instead (slower)",
                self.root,
            )
            if torch.cuda.is_available():
                torch.cuda.cudart().cudaGetLastError()  # clear the (non-sticky) error
            shutil.rmtree(self._ring_dir, ignore_errors=True)
        return ok

    def _take_free(self, need: int) -> Region | None:
        fits = [r for r in self._free if r.capacity >= need]
        if not fits:
            return None
        region = min(fits, key=lambda r: r.capacity)
        self._free.remove(region)
        return region

    def poke(self) -> None:
        """A dump on root was released in this process: look for its region now."""
        with self._cv:
            self._scan_locked()

    def _scan_locked(self) -> None:
        """Find regions released into .ring (back to free) or deleted by consumers (leaked)."""
        if not self._ring or not any(r.state == "published" for r in self._regions.values()):
            return
        changed = False
        try:
            entries = list(os.scandir(self._ring_dir))
        except FileNotFoundError:
            entries = []
        for e in entries:
            if not e.name.startswith("free-"):
                continue
            r = self._regions.get(e.inode())
            if r is None:  # not ours (a dead writer's, or a no-ring dump): reclaim the space
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(e.path)
                continue
            if r.state == "published":
                r.state = "free"
                r.path = Path(e.path)
                self._free.append(r)
                self._pending -= r.capacity
                self.released += 1
                changed = True
        for r in list(self._regions.values()):
            if r.state == "published" and r.links() == 0:
                self._leak(r, f"dump {r.path.parent} was deleted instead of released")
                changed = True
        if changed:
            self._cv.notify_all()

    def _leak(self, r: Region, why: str) -> None:
        """Lock held. Unregistering now would stall the GPU: keep the region until close()."""
        r.state = "leaked"
        self._pending -= r.capacity
        self.leaked_bytes += r.capacity
        if not self._warned_leak:
            self._warned_leak = True
            log.warning(
                "DumpWriter: %s: its %d-byte pinned region stays allocated until close() and a "
                "replacement is made; consumers should call release_dump()",
                why,
                r.capacity,
            )
        if self.leaked_bytes > self.max_pending_bytes:
            gone = [x for x in self._regions.values() if x.state == "leaked"]
            for x in gone:
                del self._regions[x.key[1]]
            self._reclaim += gone
            self.leaked_bytes = 0
            log.warning(
                "DumpWriter: leaked regions exceed max_pending_bytes: unregistering %d of them "
                "(waits for the GPU to go idle)",
                len(gone),
            )

    def _return_region(self, r: Region) -> None:
        """An open region goes back to free (abort, or open() failing)."""
        free = self._ring_dir / f"free-{uuid.uuid4().hex}"
        try:
            os.rename(r.path, free)
        except OSError:
            with self._cv:
                self._leak(r, f"region file {r.path} vanished")
            return
        with self._cv:
            r.path = free
            r.state = "free"
            self._free.append(r)
            self._pending -= r.capacity
            self._cv.notify_all()

    def _recover_region(self, pd: PendingDump) -> None:
        """Publishing failed: get the region back from wherever its file is."""
        r = pd._region
        assert r is not None
        with self._cv:
            if r.state != "open" and r.state != "published":
                return
            r.state = "open"  # not visible to scans while we move it
        for path in (pd.tmp / "tensors.safetensors", r.path):
            if path.exists() and os.stat(path).st_ino == r.key[1]:
                r.path = path
                break
        self._return_region(r)

    def _published(self, r: Region, path: Path) -> None:
        with self._cv:
            r.state = "published"
            r.path = path
            self._cv.notify_all()  # wakes the scanner

    def _want_region(self) -> int:
        """Size of the region a pool thread should make now, or 0 (lock held)."""
        cap = self._class
        if not cap or not self._ring or self._closed:
            return 0
        live = [r for r in self._regions.values() if r.state != "leaked"]
        making = self._making_sizes
        if not any(r.capacity >= cap for r in live) and not any(m >= cap for m in making):
            return cap  # growth: always, even past the bound
        for need in self._needs:  # an open() waits and nothing that fits is free or coming
            if any(r.capacity >= need for r in self._free) or any(m >= need for m in making):
                continue
            break
        else:
            spare = sum(r.capacity >= cap for r in self._free) + sum(m >= cap for m in making)
            if spare >= self._pool_size:
                return 0
        total = sum(r.capacity for r in live) + sum(making)
        return cap if total + cap <= self.max_pending_bytes else 0

    def _scanner(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(
                    lambda: (
                        self._closed or any(r.state == "published" for r in self._regions.values())
                    )
                )
                if self._closed:
                    return
                self._scan_locked()
            time.sleep(self._interval)

    def _ring_pooler(self) -> None:
        if self.pin and self.device is not None and self.device.index is not None:
            torch.cuda.set_device(self.device)
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._closed or self._reclaim or self._want_region())
                if self._closed:
                    return
                reclaim, self._reclaim = self._reclaim, []
                size = 0 if reclaim else self._want_region()
                if size:
                    self._making_sizes.append(size)
            for r in reclaim:
                r.destroy(unlink=False)
            if not size:
                continue
            region = None
            try:
                region = Region(self._ring_dir, size, self._workers)
            except BaseException as e:
                log.exception("DumpWriter: making a %d-byte region failed", size)
                with self._cv:
                    self._error = self._error or e
            finally:
                with self._cv:
                    self._making_sizes.remove(size)
                    if region is not None:
                        free = self._ring_dir / f"free-{uuid.uuid4().hex}"
                        os.rename(region.path, free)
                        region.path, region.state = free, "free"
                        self._regions[region.key[1]] = region
                        self._free.append(region)
                    self._cv.notify_all()
            if region is None:
                time.sleep(1.0)  # e.g. root is full: reported via open()/flush(); retry, no spin

    # -- plain files (no ring) ------------------------------------------------------------------
    def _short(self) -> bool:
        """More files of the current size are needed (called with the lock held)."""
        size = self._region_bytes
        have = sum(f.capacity >= size for f in self._ready) + self._making
        return bool(size) and have < self._pool_size + self._wanted

    def _pooler(self) -> None:
        if self._ring:
            self._ring_pooler()
            return
        while True:
            stale = None
            with self._cv:
                self._cv.wait_for(lambda: self._closed or self._short())
                if self._closed:
                    return
                size = self._region_bytes
                small = [f for f in self._ready if f.capacity < size]
                if small and len(self._ready) + self._making >= self._pool_size:
                    stale = small[0]  # outgrown: make room for a file of the current size
                    self._ready.remove(stale)
                self._making += 1
                self._seq_file += 1
                path = self.root / f"{POOL_PREFIX}{os.getpid()}-{self._seq_file}"
            file = None
            try:
                if stale is not None:
                    stale.discard()
                file = PreallocatedFile(path, size)
            except BaseException as e:
                log.exception("DumpWriter: allocating a %d-byte file failed", size)
                shutil.rmtree(path, ignore_errors=True)
                with self._cv:
                    self._error = self._error or e
            finally:
                with self._cv:
                    self._making -= 1
                    if file is not None:
                        self._ready.append(file)
                    self._cv.notify_all()
            if file is None:
                time.sleep(1.0)  # e.g. root is full: reported via open()/flush(); retry, no spin
