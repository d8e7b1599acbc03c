"""Read buffers: page-aligned, and recycled across reads (fresh memory costs a page fault per
4 KiB)."""

from __future__ import annotations

import sys

import numpy as np

PAGE = 4096


def page_aligned_empty(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """`np.empty` starting on a page boundary. The kernel's copy out of the page cache (rep movsb)
    ran at 2.5 GB/s into a buffer 16 bytes past a page boundary, where numpy's large arrays
    usually start, against 8.7-9.9 GB/s at offsets 0, 32..4000 (AMD EPYC VM, 256 MiB readinto,
    warm; writes showed no such dip). Which offset a process got decided its read speed."""
    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    raw = np.empty(nbytes + PAGE, np.uint8)
    start = -raw.ctypes.data % PAGE
    return raw[start : start + nbytes].view(dtype).reshape(shape)


class RecycledBuffers:
    """Read buffers handed out again once nothing refers to them any more. Samples are views
    of a block's buffer, so a buffer is free exactly when no sample (tensor or array) holds it:
    its reference count tells. Fresh memory costs a page fault per 4 KiB, which measured here
    at ~40% of a warm read; a consumer that keeps its samples simply gets new buffers.
    Not thread-safe: one thread takes buffers from a pool."""

    def __init__(self, keep: int = 4) -> None:
        self._buffers: list[np.ndarray] = []
        self._keep = keep

    def take(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        rows = shape[0]
        for buf in self._buffers:
            if _unheld(buf) and buf.shape[0] >= rows and buf.shape[1:] == shape[1:]:
                return buf[:rows]
        # Room for up to twice the rows, so that blocks of other sizes can use it later.
        buf = page_aligned_empty((1 << (rows - 1).bit_length(), *shape[1:]), dtype)
        self._buffers = [*self._buffers[1 - self._keep :], buf]  # the most recent ones
        return buf[:rows]


def _unheld(buf: np.ndarray) -> bool:
    """No view of `buf` is alive. Every view (sample, tensor) refers to the array that owns the
    memory, `buf.base`, not to `buf`: numpy collapses chains of views. References to the owner:
    `buf` and getrefcount's argument; any more is a live sample."""
    return sys.getrefcount(buf.base) == 2
