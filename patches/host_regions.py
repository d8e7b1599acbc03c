"""Host memory behind dumps: files on ``root`` that are mapped, registered with CUDA, allocated
ahead, or filled from many threads. No dump bookkeeping here; the writer decides what to make.

ctypes calls (madvise, memmove) and fallocate release the GIL, which is what lets several threads
share the work of populating or copying one buffer.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import shutil
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

_PAGE = 4096
_CHUNK = 16 << 20  # smallest piece one copy thread takes
_MADV_POPULATE_WRITE = 23
_libc = ctypes.CDLL(None, use_errno=True)


def populate(ptr: int, nbytes: int, workers: ThreadPoolExecutor, n: int = 8) -> None:
    """Allocate the pages and build the page tables of a shared mapping from n threads
    (MADV_POPULATE_WRITE; ctypes releases the GIL). Best effort: registration faults in the rest."""
    step = max(-(-nbytes // n // _PAGE) * _PAGE, _PAGE)
    jobs = [
        workers.submit(
            _libc.madvise,
            ctypes.c_void_p(p),
            ctypes.c_size_t(min(step, ptr + nbytes - p)),
            _MADV_POPULATE_WRITE,
        )
        for p in range(ptr, ptr + nbytes, step)
    ]
    for j in jobs:
        j.result()


def cuda_register(ptr: int, nbytes: int) -> bool:
    """Page-lock host memory for DMA (tests without CUDA replace this and ``cuda_unregister``)."""
    cudart = torch.cuda.cudart()
    return cudart.cudaHostRegister(ptr, nbytes, 1) == cudart.cudaError.success  # portable


def cuda_unregister(ptr: int) -> None:
    torch.cuda.cudart().cudaHostUnregister(ptr)


class Region:
    """A file under ``root/.ring`` mapped MAP_SHARED and registered with CUDA once; it keeps its
    inode (and so the mapping) through renames, whichever directory holds it."""

    def __init__(self, ring: Path, nbytes: int, workers: ThreadPoolExecutor) -> None:
        self.capacity = nbytes
        self.path = ring / f"new-{uuid.uuid4().hex}"  # scans only look at free-*
        self.state = "new"  # -> free -> open -> published -> free ... | leaked
        self.registered = False
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        self.fd = fd
        self.mm: mmap.mmap | None = None
        self.buf: torch.Tensor | None = None
        try:
            st = os.fstat(fd)
            self.key = (st.st_dev, st.st_ino)
            os.ftruncate(fd, nbytes)
            os.posix_fallocate(fd, 0, nbytes)  # GIL released
            self.mm = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            self.buf = torch.frombuffer(self.mm, dtype=torch.uint8)
            populate(self.buf.data_ptr(), nbytes, workers)
            if not cuda_register(self.buf.data_ptr(), nbytes):
                raise OSError(f"cudaHostRegister of {nbytes} bytes on {ring} failed")
            self.registered = True
        except BaseException:
            self.destroy()
            raise

    def links(self) -> int:
        return os.fstat(self.fd).st_nlink

    def destroy(self, unlink: bool = True) -> None:
        """Unregister (waits for the GPU to go idle), unmap, close; unlink if still ours."""
        if self.registered and self.buf is not None:
            cuda_unregister(self.buf.data_ptr())
            self.registered = False
        self.buf = None
        if self.mm is not None:
            with contextlib.suppress(BufferError):  # a view still lives: the GC unmaps it
                self.mm.close()
            self.mm = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        if unlink:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)


class PreallocatedFile:
    """A file on ``root`` whose pages are allocated (``fallocate``), made ahead by a pool thread
    so that neither the forward nor the publisher pays for zeroing fresh tmpfs pages."""

    def __init__(self, dirpath: Path, nbytes: int) -> None:
        dirpath.mkdir(mode=0o700)
        self.dir = dirpath
        self.capacity = nbytes
        fd = os.open(dirpath / "tensors.safetensors", os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, nbytes)
            os.posix_fallocate(fd, 0, nbytes)  # GIL released
        finally:
            os.close(fd)

    def discard(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


def copy_to_file(path: Path, src: torch.Tensor, workers: ThreadPoolExecutor, nthreads: int) -> None:
    """Copy the uint8 tensor ``src`` into the file at ``path`` (exactly as long) from several
    threads: through a shared mapping, since tmpfs serializes write() per file."""
    n = src.numel()
    fd = os.open(path, os.O_RDWR)
    try:
        mm = mmap.mmap(fd, n, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    try:
        buf = (ctypes.c_char * n).from_buffer(mm)
        dst, s = ctypes.addressof(buf), src.data_ptr()
        step = max(-(-n // nthreads // _PAGE) * _PAGE, _CHUNK)
        # ctypes calls release the GIL, so the pieces run in parallel
        jobs = [
            workers.submit(ctypes.memmove, dst + a, s + a, min(step, n - a))
            for a in range(0, n, step)
        ]
        for j in jobs:
            j.result()
        del buf
    finally:
        mm.close()


def can_register_files_in(dirpath: Path) -> bool:
    """Can a mapping of a file in ``dirpath`` be registered (tmpfs can; most disk filesystems no)?

    Raises without CUDA at all."""
    probe = dirpath / "probe"
    fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.ftruncate(fd, _PAGE)
        mm = mmap.mmap(fd, _PAGE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    buf = torch.frombuffer(mm, dtype=torch.uint8)
    ok = cuda_register(buf.data_ptr(), _PAGE)
    if ok:
        cuda_unregister(buf.data_ptr())
    del buf
    mm.close()
    os.unlink(probe)
    return ok
