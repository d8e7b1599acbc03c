"""Rows for FP8 tests: every bf16 value, under every scale a row can have, the range's ends,
and random rows over six decades (the CPU kernel's and the GPU kernel's tests share them)."""

from __future__ import annotations

import torch


def rows(n: int, width: int = 1024, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    magnitude = 10.0 ** torch.empty(n, 1).uniform_(-3, 3, generator=g)
    return (torch.randn(n, width, generator=g) * magnitude).to(torch.bfloat16)


def every_finite_bf16() -> torch.Tensor:
    """Every finite bf16 bit pattern, 256 to a row (rows of ~one binade each)."""
    x = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    return x[torch.isfinite(x)].reshape(-1, 256)


def edge_rows() -> torch.Tensor:
    """Finite rows at the ends of bf16's range."""
    bf16 = torch.finfo(torch.bfloat16)
    x = torch.zeros(7, 16)
    x[0, :3] = torch.tensor([1e-37, -3e-38, 1e-39])  # max ~2**-123: 2**(8 - e) leaves float32
    x[1, :3] = torch.tensor([bf16.max, -bf16.max, 1.0])  # the top binade: 256 * 2**120 is inf
    x[2, 0] = bf16.smallest_normal * 2**-7  # bf16's smallest subnormal, alone
    x[3] = -0.0
    x[4, :2] = torch.tensor([3e38, 2**-100])
    x[5] = torch.randn(16, generator=torch.Generator().manual_seed(1)) * 2**-128  # subnormals
    x[6, :2] = torch.tensor([2**127, -(2**127) * 1.9375])  # the top binade's rounding edge
    return x.to(torch.bfloat16)


def every_value_under_every_scale() -> torch.Tensor:
    """One row per frexp exponent of a row's max (-132 .. 128, so every scale a bf16 row can
    have): the max itself, then every finite bf16 value no larger, zeros elsewhere."""
    every = every_finite_bf16().reshape(-1)
    magnitude = every.float().abs()
    out = []
    for e in range(-132, 129):
        top = 2.0 ** (e - 1) * (1.5 if e > -125 else 1)  # exact in bf16, frexp exponent e
        top = torch.tensor(top if e < 128 else torch.finfo(torch.bfloat16).max).bfloat16()
        row = torch.where(magnitude <= top.float(), every, torch.zeros((), dtype=torch.bfloat16))
        row[0] = top
        out.append(row)
    return torch.stack(out)
