"""FP8 (e4m3) storage of hidden-state rows: one power-of-two scale per row (a token's layer).

A row x is stored as the e4m3 bits of x / s (uint8: zarr 3.1 has no fp8 dtype) and its scale s
(float32): s = 2 ** (e - 8) for max |x| = m * 2 ** e, 0.5 <= m < 1 (frexp); 0 for an all-zero
row. Scaling is exact, so the only rounding is the one to e4m3 (a row in the top binade, max
|x| >= 2 ** 127, saturates at 240 so that it never dequantizes to inf).

`quantize_rows` is the definition, in tensor ops on any device; `quantize_rows_fast`
(hsx_store/fp8_fast.py) gives its bytes in one fused pass on a GPU: the capture plugin runs it.
`quantize_into` gives the same bytes on a CPU (a C kernel, hsx_kernels/fp8_cpu.c, where the
install could build it; else the definition, slower) into the caller's buffers: the shard
writer's path for bf16 dumps; `quantize` into new arrays, in blocks of rows on the caller's
threads. Bounds, bytes, who quantizes: docs/store-format.md.
"""

from __future__ import annotations

import functools
import warnings
from concurrent.futures import Executor
from dataclasses import dataclass
from types import ModuleType

import numpy as np
import torch

FP8_DTYPE = "fp8_e4m3"  # the manifest's dtype of an FP8 store
FP8_ATTR = {"stored_as": "uint8", "dtype": "float8_e4m3fn"}
SCALE_SUFFIX = "_scale"  # hidden array "aux_hidden_states" -> scales "aux_hidden_states_scale"
# exponent(amax) - 8: |x / s| < 2 ** 8 = 256 <= 448 (e4m3's largest)
SCALE_EXPONENT_OFFSET = 8
# Rows with max |x| >= 2 ** 127 (exponent 128) have scale 2 ** 120: a value rounding up to 256
# would dequantize to 2 ** 128, inf in float32 and bf16. They saturate at 240, the e4m3 value
# below 256 (the error stays under the bound, 2 ** -4 relative: 15 / 255).
TOP_EXPONENT, TOP_LIMIT = 128, 240.0
E4M3_NAN = 0x7F  # e4m3fn has no inf: |bits| == 0x7F is NaN
# CPU blocks: bf16 bytes of rows quantized at once (a task of the caller's pool).
BLOCK_BYTES = 1 << 20


def scale_name(hidden: str) -> str:
    """The scale array of the hidden array `hidden` in an FP8 store."""
    return hidden + SCALE_SUFFIX


@dataclass(frozen=True)
class Fp8Rows:
    """Rows already quantized (by the capture plugin): e4m3 values [P, ..., H] (uint8 bits or
    float8_e4m3fn) and their float32 scales [P, ...]."""

    values: torch.Tensor
    scales: torch.Tensor

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.values.shape)

    @property
    def nbytes(self) -> int:
        return self.values.nbytes + self.scales.nbytes


def _pow2(k: torch.Tensor) -> torch.Tensor:
    """2.0 ** k as float32, exactly, for int32 k in [-126, 127] (built from its bits)."""
    return ((k + 127) << 23).view(torch.float32)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., H] (bf16 or float32, any device) as (e4m3 values [..., H], float32 scales [...]),
    on x's device. Tensor ops only, no host synchronization: the capture plugin runs it on a
    CUDA side stream. A row holding an inf or NaN gets a NaN scale and NaN values."""
    amax = x.abs().amax(dim=-1, keepdim=True).float()
    finite = torch.isfinite(amax)
    exponent = torch.where(finite, torch.frexp(amax).exponent, 0)
    # x / s = x * 2 ** (8 - e) and s = 2 ** (e - 8), each in two exact halves: one power of two
    # leaves float32's normal range for the smallest rows (and 0 * inf made NaN of their zeros).
    # A non-finite row is multiplied by NaN: the cast saturates inf to 448, which would hide it.
    k = SCALE_EXPONENT_OFFSET - exponent
    first = torch.where(finite, _pow2(k // 2), torch.nan)
    scaled = x.to(torch.float32, copy=True).mul_(first).mul_(_pow2(k - k // 2))
    limit = torch.where(exponent >= TOP_EXPONENT, TOP_LIMIT, torch.inf)
    scaled = scaled.clamp_(-limit, limit)
    e = exponent - SCALE_EXPONENT_OFFSET
    scale = torch.where(amax > 0, _pow2(e // 2) * _pow2(e - e // 2), 0.0)
    scale = torch.where(finite, scale, torch.nan).squeeze(-1)
    return scaled.to(torch.float8_e4m3fn), scale


def quantize(
    x: torch.Tensor, what: str, pool: Executor | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """x [P, ..., H] on the CPU as (e4m3 bits uint8 [P, ..., H], scales float32 [P, ...]): the
    bytes `quantize_rows` gives, in blocks of rows, on `pool`'s threads when given (every step
    releases the GIL). Raises ValueError, naming `what` and the first row, if x holds an inf or
    NaN: an FP8 store keeps finite values only."""
    if x.ndim < 2:
        raise ValueError(f"{what}: expected rows [P, ..., H], got shape {tuple(x.shape)}")
    width = x.shape[-1]
    rows = x.reshape(-1, width)
    values = np.empty(rows.shape, np.uint8)
    scales = np.empty(len(rows), np.float32)
    step = max(1, BLOCK_BYTES // (2 * max(1, width)))
    spans = [(lo, min(lo + step, len(rows))) for lo in range(0, len(rows), step)]

    def block(span: tuple[int, int]) -> int | None:
        lo, hi = span
        bad = quantize_into(rows[lo:hi], values[lo:hi], scales[lo:hi])
        return None if bad is None else lo + bad

    firsts = map(block, spans) if pool is None else pool.map(block, spans)
    bad = [b for b in firsts if b is not None]
    if bad:
        row = tuple(int(r) for r in np.unravel_index(bad[0], x.shape[:-1]))
        raise ValueError(
            f"{what}: non-finite value in row {row}; an FP8 store keeps finite values only"
        )
    return values.reshape(x.shape), scales.reshape(x.shape[:-1])


@functools.cache
def cpu_kernel() -> ModuleType | None:
    """The C kernel (hsx_kernels.fp8_cpu), or None where the install could not build it
    (setup.py): then `quantize_into` runs the definition, and this warns, once. The only import
    of the kernel, so that readers, verify and export never need it."""
    try:
        from hsx_kernels import fp8_cpu
    except ImportError as error:
        warnings.warn(
            f"the CPU FP8 quantizer's kernel is not built ({error}): bf16 rows are quantized "
            "for FP8 stores by the definition in torch, the same bytes an order of magnitude "
            "slower; reinstall (`pip install -e .`) with a C compiler and Python's headers to "
            "build it (docs/getting-started.md)",
            RuntimeWarning,
            stacklevel=2,
        )
        return None
    return fp8_cpu


def quantize_into(
    x: torch.Tensor | np.ndarray, values: np.ndarray, scales: np.ndarray
) -> int | None:
    """Quantize rows x [..., H] (a bf16 or float32 tensor, or bf16 bits as uint16) into
    `values` (e4m3 bits, uint8 [..., H]) and `scales` (float32 [...]), all C-contiguous: the
    bytes `quantize_rows` gives. Returns the first row (flat over [...]) holding an inf or NaN,
    whose values and the rows' after it are then unspecified; else None. bf16 rows go through
    the C kernel (hsx_kernels/fp8_cpu.c, without the GIL) where it is built, the rows it leaves
    and float32 rows (every row, without it) through the definition. Cheap to call on a few
    rows: the shard writer quantizes a few MB at a time (actors/shard_writer.py
    `QUANTIZE_BLOCK_BYTES`)."""
    if not (values.flags.c_contiguous and scales.flags.c_contiguous):
        raise ValueError("quantize_into writes C-contiguous values and scales only")
    width = x.shape[-1]
    out, row_scales = values.reshape(-1, width), scales.reshape(-1)  # views
    if isinstance(x, np.ndarray):
        if x.dtype not in (np.uint16, np.int16):
            raise ValueError(f"expected bf16 bits (uint16), got {x.dtype}")
        bits = x.reshape(-1, width).view(np.int16)
    elif x.dtype == torch.bfloat16:
        bits = x.reshape(-1, width).view(torch.int16).numpy()
    else:
        bits = None
    fallback = np.ones(len(out), np.uint8)
    kernel = cpu_kernel() if bits is not None else None
    if kernel is not None:
        bad = kernel.quantize_bf16_rows(bits, out, row_scales, fallback)
        if bad >= 0:
            return bad
        if not fallback.any():
            return None
    rows = x if isinstance(x, torch.Tensor) else torch.from_numpy(bits).view(torch.bfloat16)
    rows = rows.reshape(-1, width)
    left = torch.from_numpy(np.flatnonzero(fallback))
    q, s = quantize_rows(rows[left])
    if s.isnan().any():
        return int(left[s.isnan()][0])
    out[left.numpy()], row_scales[left.numpy()] = q.view(torch.uint8).numpy(), s.numpy()
    return None


def dequantize(
    bits: np.ndarray | torch.Tensor,
    scales: np.ndarray | torch.Tensor,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Stored rows (e4m3 bits [..., H], scales [...]) as `dtype` values: q * s (exact in
    float32), then cast."""
    q = as_float8(bits)
    s = torch.as_tensor(np.ascontiguousarray(scales), dtype=torch.float32)
    return (q.to(torch.float32) * s.unsqueeze(-1)).to(dtype)


def as_float8(bits: np.ndarray | torch.Tensor) -> torch.Tensor:
    """Stored e4m3 bits as a torch float8_e4m3fn tensor (a view, no copy)."""
    if isinstance(bits, torch.Tensor):
        return bits if bits.dtype == torch.float8_e4m3fn else bits.view(torch.float8_e4m3fn)
    return torch.from_numpy(np.ascontiguousarray(bits)).view(torch.float8_e4m3fn)


# e4m3fn's magnitudes by their 7 low bits (NaN at 0x7F)
_E4M3_MAGNITUDES = torch.arange(128, dtype=torch.uint8).view(torch.float8_e4m3fn).float().numpy()


def invalid_rows(
    bits: np.ndarray, scales: np.ndarray, block_bytes: int = 1 << 20
) -> tuple[np.ndarray, np.ndarray]:
    """Per row (axis 0) of stored FP8 values (bits uint8 [P, ..., H], scales [P, ...]):
    (a value is NaN or dequantizes beyond float32's range, a scale is not 0 or a finite
    positive power of two). Scans the bits in blocks of rows (a small temporary)."""
    p = len(bits)
    bits = bits.reshape(p, -1, bits.shape[-1])
    scale = np.asarray(scales, np.float32).reshape(p, -1)
    with np.errstate(invalid="ignore"):
        mantissa = np.frexp(scale)[0]
    bad_scale = ~np.isfinite(scale) | (scale < 0) | ((scale > 0) & (mantissa != 0.5))
    top = np.empty(scale.shape, np.uint8)  # each row's largest magnitude, as its low 7 bits
    step = max(1, block_bytes // max(1, bits[0].nbytes))
    for lo in range(0, p, step):  # e4m3 magnitudes order like their bits
        np.bitwise_and(bits[lo : lo + step], 0x7F).max(axis=2, out=top[lo : lo + step])
    overflow = _E4M3_MAGNITUDES[top].astype(np.float64) * scale >= 2.0**128
    bad_value = (top == E4M3_NAN) | (overflow & ~bad_scale)
    return bad_value.any(axis=1), bad_scale.any(axis=1)
