"""Scans of one stored array along its rows, for the store's checks (hsx_store/integrity.py):
which chunk rows are stored (one key listing), and which rows hold non-finite values or are all
zero (read in chunk-aligned blocks of bounded size, whatever the store's size)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import zarr
from zarr.core.sync import sync

from hsx_store.fp8 import invalid_rows

BLOCK_BYTES = 128 << 20  # rows of one hidden array read at once
RowFlags = tuple[np.ndarray, np.ndarray]  # per row: (holds a non-finite value, is all zero)


def stored_chunk_rows(arr: zarr.Array) -> np.ndarray | None:
    """Which chunk rows (index along axis 0) of an array are stored, from one key listing;
    None when the store cannot list. Keys are parsed as they stream by, never all held."""
    path = arr.store_path
    if not path.store.supports_listing:
        return None
    # With a trailing slash: memory/fsspec stores match prefixes as plain strings.
    prefix = f"{path.path}/" if path.path else ""
    # zarr 3.1.6's DefaultChunkKeyEncoding.decode_chunk_key cannot parse its own "c/5/0/0"
    # (it splits "/5/0/0" and fails on the empty first part), so keys are parsed here.
    sep = arr.metadata.chunk_key_encoding.separator
    head = f"{prefix}c{sep}"
    grid = arr.cdata_shape
    present = np.zeros(grid[0], bool)

    async def scan() -> None:
        async for key in path.store.list_prefix(prefix):
            if not key.startswith(head):
                continue  # zarr.json
            coords = key[len(head) :].split(sep)
            if len(coords) == len(grid) and all(c.isdigit() for c in coords):
                row, rest = int(coords[0]), coords[1:]
                if row < grid[0] and not any(int(c) for c in rest):
                    present[row] = True

    sync(scan())
    return present


def row_bytes(arr: zarr.Array) -> int:
    return max(1, int(np.prod(arr.shape[1:])) * arr.dtype.itemsize)


def scan_blocks(
    arr: zarr.Array,
    start: int,
    stop: int,
    block_flags: Callable[[int, int], RowFlags],
    block_bytes: int = BLOCK_BYTES,
) -> RowFlags:
    """The flags of rows start..stop-1 of `arr`, from `block_flags(lo, hi)` on chunk-aligned
    blocks of about `block_bytes` of it (one chunk at least)."""
    chunk = arr.chunks[0]
    step = max(chunk, block_bytes // row_bytes(arr) // chunk * chunk)
    nonfinite = np.zeros(stop - start, bool)
    zero = np.zeros(stop - start, bool)
    for lo in range(start, stop, step):
        hi = min(stop, lo + step)
        nonfinite[lo - start : hi - start], zero[lo - start : hi - start] = block_flags(lo, hi)
    return nonfinite, zero


def row_flags(arr: zarr.Array, start: int, stop: int, block_bytes: int = BLOCK_BYTES) -> RowFlags:
    """(row holds a non-finite value, row is all zero) for rows start..stop-1. uint16 arrays
    hold bf16 bits."""

    def block_flags(lo: int, hi: int) -> RowFlags:
        x = np.asarray(arr[lo:hi]).reshape(hi - lo, -1)
        if x.dtype == np.uint16:  # bf16: exponent all ones is inf or NaN; +-0 is zero
            return ((x & 0x7F80) == 0x7F80).any(axis=1), ~(x & 0x7FFF).any(axis=1)
        return ~np.isfinite(x).all(axis=1), ~x.any(axis=1)

    return scan_blocks(arr, start, stop, block_flags, block_bytes)


def fp8_row_flags(
    values: zarr.Array, scales: zarr.Array, start: int, stop: int, block_bytes: int = BLOCK_BYTES
) -> RowFlags:
    """row_flags of an FP8 hidden array: a row is non-finite where an e4m3 value is NaN or
    dequantizes beyond float32's range, or its scale is not 0 or a finite positive power of two
    (hsx_store/fp8.py `invalid_rows`); zero where its scale is 0 or every value is +-0 (the
    dequantized row is all zero)."""

    def block_flags(lo: int, hi: int) -> RowFlags:
        bits = np.asarray(values[lo:hi]).reshape(hi - lo, -1, values.shape[-1])
        scale = np.asarray(scales[lo:hi], np.float32).reshape(hi - lo, -1)
        bad_value, bad_scale = invalid_rows(bits, scale)
        zero_layer = (scale == 0) | ~(bits & 0x7F).any(axis=2)
        return bad_value | bad_scale, zero_layer.all(axis=1)

    return scan_blocks(values, start, stop, block_flags, block_bytes)
