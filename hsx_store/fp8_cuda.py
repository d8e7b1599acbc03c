"""The GPU quantizer: hsx_store/fp8.py `quantize_rows` as one fused Triton kernel.

The definition is ten tensor ops, each a pass over the rows in float32: ~41 bytes of memory
traffic per value, and ten launches on the capture's side stream. This kernel reads each row
once (bf16 or float32), keeps it in registers, and writes its e4m3 bytes and its scale: 3 bytes
per bf16 value. The arithmetic is the definition's, step for step (frexp's exponent from the
bits, the two exact power-of-two multiplies in the same order, the top binade clamped at 240, a
non-finite row multiplied by NaN, round-to-nearest-even to e4m3), so the bytes are the same:
tests compare them on every bf16 value under every scale.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hsx_store.fp8 import SCALE_EXPONENT_OFFSET, TOP_EXPONENT, TOP_LIMIT

MAX_ROW = 1 << 16  # widest row one program holds in registers (Kimi's: 7,168)
# The definition's constants, as the kernel reads globals
OFFSET = tl.constexpr(SCALE_EXPONENT_OFFSET)
TOP_E = tl.constexpr(TOP_EXPONENT)
TOP = tl.constexpr(TOP_LIMIT)


@triton.jit
def _pow2(k):
    """2.0 ** k as float32, exactly, for int32 k in [-126, 127] (built from its bits)."""
    return ((k + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _quantize_rows_kernel(x_ptr, values_ptr, scales_ptr, width, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offsets = tl.arange(0, BLOCK)
    inside = offsets < width
    x = tl.load(x_ptr + row * width + offsets, mask=inside, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=0)  # ignores NaN (fmax), unlike torch's amax: counted apart
    finite = (amax < float("inf")) & (tl.sum((x != x).to(tl.int32), axis=0) == 0)
    # frexp's exponent: max |x| = m * 2 ** e, 0.5 <= m < 1; a subnormal max is made normal
    # first (times 2 ** 64, exact); 0 for 0, as torch.frexp gives.
    subnormal = amax < 1.1754943508222875e-38
    normal = tl.where(subnormal, amax * 18446744073709551616.0, amax)
    biased = (normal.to(tl.int32, bitcast=True) >> 23) & 0xFF
    exponent = tl.where(subnormal, biased - 126 - 64, biased - 126)
    exponent = tl.where(finite & (amax > 0), exponent, 0)
    k = OFFSET - exponent
    first = tl.where(finite, _pow2(k >> 1), float("nan"))  # >> 1: floor, as torch's // 2
    scaled = x * first * _pow2(k - (k >> 1))
    limit = tl.where(exponent >= TOP_E, TOP, float("inf"))
    scaled = tl.where(scaled > limit, limit, tl.where(scaled < -limit, -limit, scaled))  # NaN stays
    tl.store(values_ptr + row * width + offsets, scaled.to(tl.float8e4nv), mask=inside)
    e = exponent - OFFSET
    scale = tl.where(amax > 0, _pow2(e >> 1) * _pow2(e - (e >> 1)), 0.0)
    tl.store(scales_ptr + row, tl.where(finite, scale, float("nan")))


def quantize_rows_cuda(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_rows(x)` for a CUDA tensor x [..., H] (bf16 or float32): the same bytes, on the
    current stream, no host synchronization."""
    width = x.shape[-1]
    if not x.is_cuda or width > MAX_ROW or x.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"quantize_rows_cuda: a CUDA bf16/float32 tensor of rows up to {MAX_ROW}")
    x = x.contiguous()
    values = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
    rows = x.numel() // max(width, 1)
    if rows:
        block = triton.next_power_of_2(width)
        warps = max(1, min(16, block // 512))
        _quantize_rows_kernel[(rows,)](x, values, scales, width, BLOCK=block, num_warps=warps)
    return values, scales
