"""FP8 (e4m3) storage of hidden-state rows: one scale per row (a token's layer).

A row x is stored as the e4m3 bits of x / s (uint8: zarr 3.1 has no fp8 dtype) and its scale s
(float32): s = 2 ** (e - 8) for max |x| = m * 2 ** e, 0.5 <= m < 1 (frexp); 0 for an all-zero
row. A power of two, so nothing saturates and scaling and dequantizing are exact: the only
rounding is the one to e4m3. Non-finite input is refused (ValueError naming the row).

Quantizing works on blocks of rows of QUANT_BLOCK_BYTES (as float32): reductions and scaling in
numpy, casts in torch on blocks below its parallel grain (torch's row reductions stalled on a
busy 2-core machine).

Why a power of two, the error bounds, the bytes: docs/store-format.md.
"""

from __future__ import annotations

import numpy as np
import torch

FP8_DTYPE = "fp8_e4m3"  # the manifest's dtype of an FP8 store
FP8_ATTR = {"stored_as": "uint8", "dtype": "float8_e4m3fn"}
SCALE_SUFFIX = "_scale"  # hidden array "aux_hidden_states" -> scales "aux_hidden_states_scale"
# exponent(amax) - 8: |x / s| < 2 ** 8 = 256 <= 448
SCALE_EXPONENT_OFFSET = 8
QUANT_BLOCK_BYTES = 1 << 17  # float32 rows converted at once (see quantize)


def scale_name(hidden: str) -> str:
    """The scale array of the hidden array `hidden` in an FP8 store."""
    return hidden + SCALE_SUFFIX


def quantize(x: torch.Tensor, what: str) -> tuple[np.ndarray, np.ndarray]:
    """x [P, ..., H] (any float dtype) as (e4m3 bits uint8 [P, ..., H], scales float32
    [P, ...]): one scale per row of the last axis. Raises ValueError, naming `what` and the
    first row, if x holds an inf or NaN."""
    if x.ndim < 2:
        raise ValueError(f"{what}: expected rows [P, ..., H], got shape {tuple(x.shape)}")
    width = x.shape[-1]
    rows = x.reshape(-1, width)
    values = torch.empty(rows.shape, dtype=torch.float8_e4m3fn)
    scales = np.empty(len(rows), np.float32)
    step = max(1, QUANT_BLOCK_BYTES // (4 * max(1, width)))
    block = torch.empty((min(step, len(rows)), width), dtype=torch.float32)
    magnitude = np.empty(block.shape, np.float32)
    for lo in range(0, len(rows), step):
        n = len(rows[lo : lo + step])
        tmp, tmp_np = block[:n], block[:n].numpy()
        tmp.copy_(rows[lo : lo + n])
        amax = np.abs(tmp_np, out=magnitude[:n]).max(axis=1)  # NaN and inf stay non-finite
        if not np.isfinite(amax).all():
            first = lo + int(np.flatnonzero(~np.isfinite(amax))[0])
            row = tuple(int(r) for r in np.unravel_index(first, x.shape[:-1]))
            raise ValueError(
                f"{what}: non-finite value in row {row}; an FP8 store keeps finite values only"
            )
        exponent = np.frexp(amax)[1] - SCALE_EXPONENT_OFFSET
        scale = np.where(amax > 0, np.ldexp(np.float32(1), exponent), np.float32(0))
        # x / s as x * (1 / s): exact, s being a power of two
        np.multiply(tmp_np, np.ldexp(np.float32(1), -exponent)[:, None], out=tmp_np)
        values[lo : lo + n] = tmp  # rounds to nearest even
        scales[lo : lo + n] = scale
    return values.view(torch.uint8).numpy().reshape(x.shape), scales.reshape(x.shape[:-1])


def dequantize(
    bits: np.ndarray | torch.Tensor,
    scales: np.ndarray | torch.Tensor,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Stored rows (e4m3 bits [..., H], scales [...]) as `dtype` values: q * s (exact in
    float32), then cast."""
    q = torch.as_tensor(np.ascontiguousarray(bits)).view(torch.float8_e4m3fn)
    s = torch.as_tensor(np.ascontiguousarray(scales), dtype=torch.float32)
    return (q.to(torch.float32) * s.unsqueeze(-1)).to(dtype)


def as_float8(bits: np.ndarray) -> torch.Tensor:
    """Stored e4m3 bits as a torch float8_e4m3fn tensor (a view, no copy)."""
    return torch.from_numpy(np.ascontiguousarray(bits)).view(torch.float8_e4m3fn)
