"""The row scans of the chunks and values checks: the same flags however the rows are blocked,
bf16 / float32 and FP8 alike, and the stored chunk rows from the key listing."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import zarr

from hsx_store.row_scan import fp8_row_flags, row_flags, stored_chunk_rows
from tests.helpers.synthetic import build_store

BLOCKS = (1, 8 * 48, 16 * 48)  # one chunk at least, however small the budget


def same(a: tuple[np.ndarray, np.ndarray], b: tuple[np.ndarray, np.ndarray]) -> bool:
    return all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))


def test_values_are_read_in_bounded_blocks(tmp_path: Path) -> None:
    path = build_store(tmp_path / "s.zarr")
    arr = zarr.open_group(path, mode="r")["aux_hidden_states"]
    whole = row_flags(arr, 32, 60)
    for block in BLOCKS:
        assert same(row_flags(arr, 32, 60, block), whole)
    assert not whole[0].any()
    assert np.flatnonzero(whole[1]).tolist() == [23, 24]  # rows 55, 56: sample 6, failed


def test_fp8_rows_are_flagged_alike_in_every_block_size() -> None:
    """Rows of [3, 8] e4m3 values, chunks of 8 rows: a NaN value, a bad scale, a zero scale and
    all-zero values are flagged in their rows whatever the block."""
    group = zarr.open_group(zarr.storage.MemoryStore(), mode="w")
    rng = np.random.default_rng(0)
    bits = rng.integers(0x08, 0x70, (40, 3, 8), dtype=np.uint8)  # finite, none +-0
    scales = np.ones((40, 3), np.float32)
    bits[9, 1, 4] = 0x7F  # e4m3 NaN
    scales[17, 2] = 3.0  # not a power of two
    scales[21] = 0.0  # every layer's scale 0: the row dequantizes to zero
    bits[30] = 0x80  # -0 everywhere
    values = group.create_array("v", data=bits, chunks=(8, 3, 8))
    scale = group.create_array("v_scale", data=scales, chunks=(8, 3))
    whole = fp8_row_flags(values, scale, 4, 36)
    for block in BLOCKS:
        assert same(fp8_row_flags(values, scale, 4, 36, block), whole)
    assert np.flatnonzero(whole[0]).tolist() == [9 - 4, 17 - 4]
    assert np.flatnonzero(whole[1]).tolist() == [21 - 4, 30 - 4]


def test_the_stored_chunk_rows_come_from_the_key_listing(tmp_path: Path) -> None:
    path = build_store(tmp_path / "s.zarr")
    (path / "aux_hidden_states" / "c" / "5" / "0" / "0").unlink()
    present = stored_chunk_rows(zarr.open_group(path, mode="r")["aux_hidden_states"])
    assert present is not None and np.flatnonzero(~present).tolist() == [5]
