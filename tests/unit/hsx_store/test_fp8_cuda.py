"""The FP8 quantizer on a GPU (the capture plugin's) gives the CPU quantizer's bytes (the shard
writer's): every finite bf16 value, rows at the ends of the range, float32 rows."""

from __future__ import annotations

import numpy as np
import torch

from hsx_store.fp8 import quantize, quantize_rows


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
