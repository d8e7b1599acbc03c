"""`quantize_rows` by the fastest path for a tensor: the fused Triton kernel on CUDA
(hsx_store/fp8_cuda.py, the same bytes in one pass), elsewhere or without Triton the definition
(hsx_store/fp8.py). What the capture plugin runs on its side stream.

Apart from both: the kernel is built from the definition's constants, so the definition never
imports its kernel.
"""

from __future__ import annotations

import torch

from hsx_store.fp8 import quantize_rows


def quantize_rows_fast(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_rows(x)`: on CUDA (bf16 or float32 rows up to the kernel's width) by the fused
    kernel, no host synchronization; otherwise by the definition."""
    if x.is_cuda and x.dtype in (torch.bfloat16, torch.float32):
        try:  # Triton is optional: a CPU-only install has none
            from hsx_store.fp8_cuda import MAX_ROW, quantize_rows_cuda
        except ImportError:
            return quantize_rows(x)
        if x.shape[-1] <= MAX_ROW:
            return quantize_rows_cuda(x)
    return quantize_rows(x)
