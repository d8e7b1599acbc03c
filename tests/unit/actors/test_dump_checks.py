"""The value check of check_dump: the first token row holding an inf or NaN, scanned blockwise."""

from __future__ import annotations

import pytest
import torch

from actors import dump_checks
from actors.dump_checks import _first_non_finite_row


def whole_tensor_answer(x: torch.Tensor) -> int | None:
    bad = ~torch.isfinite(x.float()).reshape(len(x), -1).all(dim=1)
    return int(bad.nonzero()[0]) if bool(bad.any()) else None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan"), -float("nan")])
def test_first_non_finite_row_across_blocks(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, value: float
) -> None:
    monkeypatch.setattr(dump_checks, "SCAN_BLOCK_BYTES", 3 * 2 * 8 * 4)  # a few rows a block
    x = torch.randn(37, 2, 8).to(dtype)
    x[0, 0, 0] = torch.finfo(dtype).max  # largest finite: not flagged
    assert _first_non_finite_row(x) is None
    for row in (36, 20, 13, 12):  # later rows first: the first one is always reported
        x[row, 1, row % 8] = value
        assert _first_non_finite_row(x) == row == whole_tensor_answer(x)


def test_every_bf16_bit_pattern() -> None:
    bits = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16)
    x = bits.view(torch.bfloat16).reshape(-1, 1)
    finite = torch.isfinite(x.float()).reshape(-1)
    for row in range(0, len(x), 4099):
        block = x[row : row + 4099]
        assert _first_non_finite_row(block) == whole_tensor_answer(block)
    assert int(finite.sum()) == (1 << 16) - 2 * 128  # exponent all ones: 128 per sign


def test_empty() -> None:
    assert _first_non_finite_row(torch.empty(0, 3, 4, dtype=torch.bfloat16)) is None
