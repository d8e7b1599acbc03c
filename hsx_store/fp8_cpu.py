"""The CPU quantizer's kernel: bf16 rows to e4m3 bits and power-of-two scales (numba).

Arithmetic on the bf16 bits, three passes over a row (its largest magnitude, the magnitudes
widened to float32, then each value), vectorized by LLVM and free of the GIL: torch's own cast
to e4m3 is scalar (~3 GB/s of bf16 a core here), slower than writing the bytes. The bytes are
those of hsx_store/fp8.py `quantize_rows` (the definition, which the GPU runs): tests compare
every bf16 value under every scale. Rows whose largest magnitude is below 2 ** -93 are left to
the definition (`fallback`): bf16 subnormals matter there, and the kernel flushes them.
"""

from __future__ import annotations

import math

import numba
import numpy as np

SMALLEST_EXPONENT = -92  # frexp exponent of the smallest max |x| the kernel takes: 2 ** -93


@numba.njit(nogil=True, cache=True, boundscheck=False)
def quantize_bf16_rows(
    bits: np.ndarray, out: np.ndarray, scales: np.ndarray, fallback: np.ndarray
) -> int:
    """bits int16 [n, h] (bf16) -> out uint8 [n, h] (e4m3), scales float32 [n]; fallback
    bool [n]: the rows left to the definition. Returns the first non-finite row, or -1."""
    n, h = bits.shape
    wide = np.empty(h, np.int32)  # a row's magnitudes as float32 bits (bf16 is their top half)
    magnitudes = wide.view(np.float32)
    for r in range(n):
        row = bits[r]
        amax = 0
        for j in range(h):
            amax = max(amax, row[j] & 0x7FFF)  # magnitudes order like their bits
        if amax >= 0x7F80:  # exponent all ones: inf or NaN
            return r
        biased = amax >> 7
        fallback[r] = amax > 0 and biased - 126 < SMALLEST_EXPONENT
        if fallback[r]:
            continue
        e = biased - 126 if amax else 0  # frexp: max |x| = m * 2 ** e, 0.5 <= m < 1
        scales[r] = math.ldexp(1.0, e - 8) if amax else 0.0
        k = 8 - e  # x / scale = x * 2 ** k
        top = 0x77 if e >= 128 else 0x7E  # the top binade saturates at 240 (hsx_store/fp8.py)
        shifted = (k - 120) << 7  # bf16 exponent + k, rebased on e4m3's bias (7)
        to_grid = np.float32(math.ldexp(1.0, k + 9))  # |x| * 2 ** k in units of 2 ** -9
        for j in range(h):
            wide[j] = np.int32(row[j] & 0x7FFF) << 16
        for j in range(h):
            b = row[j]
            m2 = (b & 0x7FFF) + shifted
            # e4m3 normal (|x / s| >= 2 ** -6): round the 7 mantissa bits to 3, nearest even;
            # a carry moves into the exponent as it should.
            normal = (m2 + 7 + ((m2 >> 4) & 1)) >> 4
            # e4m3 subnormal: a multiple of 2 ** -9, nearest even, by float32 arithmetic (the
            # scaling is exact; adding 2 ** 23 rounds to an integer). Zeros and bf16
            # subnormals (below 2 ** -126 * 2 ** 100) come out 0 here.
            grid = magnitudes[j] * to_grid
            sub = np.int32((grid + np.float32(8388608.0)) - np.float32(8388608.0))
            q = normal if m2 >= 128 else sub
            out[r, j] = min(q, top) | ((b >> 8) & 0x80)
    return -1
