"""The CPU FP8 kernel's check against the definition (hsx_store/fp8.py `quantize_rows`), shared
by the installed kernel's test and the builds of its source by other compilers."""

from __future__ import annotations

import functools
from types import ModuleType

import numpy as np
import pytest
import torch

from hsx_store.fp8 import quantize_rows
from tests.helpers.fp8_rows import edge_rows, every_value_under_every_scale, rows


@functools.cache
def cases() -> tuple[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray], ...]:
    """(bf16 bits, the definition's e4m3 bits and scales, the rows left to it) of every bf16
    value under every scale, the range's ends, and rows whose length leaves a partial last
    vector: made once, for every variant of every build (making them takes seconds)."""
    out = []
    for x in (every_value_under_every_scale(), edge_rows().repeat(1, 16), rows(8, 100)):
        values, scales = quantize_rows(x)
        exponent = torch.frexp(x.float().abs().amax(1)).exponent
        left = (exponent < -92) & (x != 0).any(1)  # below 2 ** -93
        bits = x.view(torch.int16).numpy()
        out.append((bits, values.view(torch.uint8).numpy(), scales.numpy(), left.numpy()))
    return tuple(out)


def check_variant(kernel: ModuleType, variant: str) -> None:
    """One variant of a build of hsx_kernels/fp8_cpu.c (`kernel`, the module) gives the
    definition's bytes on `cases()`, leaves it the rows below 2 ** -93, and finds the first
    non-finite row, in a row's last lanes too (the next row's maximum is found while a row is
    quantized)."""
    for bits, want_values, want_scales, want_left in cases():
        values, scales = np.zeros(bits.shape, np.uint8), np.zeros(len(bits), np.float32)
        fallback = np.ones(len(bits), np.uint8)
        assert kernel.quantize_bf16_rows(bits, values, scales, fallback, variant) == -1
        assert fallback.astype(bool).tolist() == want_left.tolist()
        kept = ~want_left
        assert np.array_equal(values[kept], want_values[kept])
        assert np.array_equal(scales[kept], want_scales[kept])
    for row, column in ((0, 3), (4, 98), (7, 99)):  # 100 = 3 vectors of 32 and 4 lanes
        x = rows(8, 100)
        x[row, column] = float("inf") if row % 2 else float("nan")
        out = np.zeros((8, 100), np.uint8), np.zeros(8, np.float32), np.ones(8, np.uint8)
        assert kernel.quantize_bf16_rows(x.view(torch.int16).numpy(), *out, variant) == row
    with pytest.raises(ValueError, match="variant sse9: not one this CPU runs"):
        kernel.quantize_bf16_rows(bits, values, scales, fallback, "sse9")
