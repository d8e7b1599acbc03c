"""The FP8 quantizers on a GPU (the definition, and the fused kernel the capture plugin runs)
give the CPU quantizer's bytes (the shard writer's): every finite bf16 value, under every scale,
rows at the ends of the range, float32 rows."""

from __future__ import annotations

import numpy as np
import torch

from hsx_store.fp8 import quantize, quantize_rows
from hsx_store.fp8_fast import quantize_rows_fast
from tests.helpers.fp8_rows import edge_rows, every_value_under_every_scale, rows


def test_the_gpu_quantizer_gives_the_cpu_quantizers_bytes(cuda_device: torch.device) -> None:
    every = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16)
    every = every.view(torch.bfloat16)
    bf16 = torch.finfo(torch.bfloat16)
    edges = torch.zeros(4, 256)
    edges[0, :2] = torch.tensor([bf16.max, -1.0])  # the top binade saturates at 240
    edges[1, :2] = torch.tensor([1e-37, -1e-39])  # 2 ** (8 - e) beyond float32
    edges[2, 0] = bf16.smallest_normal * 2**-7
    edges[3] = -0.0
    g = torch.Generator().manual_seed(0)
    random = torch.randn(512, 256, generator=g) * 10.0 ** torch.empty(512, 1).uniform_(-20, 20)
    rows = torch.cat([every[torch.isfinite(every)].reshape(-1, 256), edges.bfloat16()])
    for x in (rows, random.bfloat16(), random):
        values, scales = quantize_rows(x.to(cuda_device))
        bits, want_scales = quantize(x, "x")
        assert np.array_equal(values.view(torch.uint8).cpu().numpy(), bits)
        assert np.array_equal(scales.cpu().numpy(), want_scales)
    # A non-finite row: NaN scale and NaN bits on the GPU too.
    x = random[:4].clone()
    x[1, 0], x[2, 3] = float("inf"), float("nan")
    values, scales = quantize_rows(x.to(cuda_device))
    assert scales.isnan().cpu().tolist() == [False, True, True, False]
    nan = (values.view(torch.uint8) & 0x7F) == 0x7F
    assert nan.any(dim=1).cpu().tolist() == [False, True, True, False]


def test_the_fused_kernel_gives_the_definitions_bytes(cuda_device: torch.device) -> None:
    """quantize_rows_fast (one Triton kernel, the capture plugin's path) against quantize_rows
    (the definition) on the same GPU: every bf16 value under every scale, the range's ends,
    random rows, float32 rows, a Kimi-wide row, and rows with an inf or a NaN."""
    from hsx_store.fp8_cuda import quantize_rows_cuda

    x = every_value_under_every_scale()
    small = torch.cat([edge_rows().repeat(1, 16), rows(64, 256)])
    kimi = rows(64, 7168, seed=3).reshape(16, 4, 7168)
    poisoned = rows(4, 256, seed=4)
    poisoned[1, 7], poisoned[2, 9], poisoned[3, 0] = float("inf"), float("nan"), -float("inf")
    for rows_in in (x, small, small.float(), kimi, poisoned):
        got = quantize_rows_cuda(rows_in.to(cuda_device))
        want = quantize_rows(rows_in.to(cuda_device))
        assert got[0].shape == want[0].shape and got[1].shape == want[1].shape
        assert torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8))
        assert torch.equal(got[1].nan_to_num(-1.0), want[1].nan_to_num(-1.0))  # NaN rows too
    assert quantize_rows_fast(kimi.to(cuda_device))[0].dtype == torch.float8_e4m3fn
