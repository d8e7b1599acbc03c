"""check_dump's value checks: the first token row holding an inf or NaN (scanned blockwise), and
dumps the server quantized for an FP8 store (NaN bits, scales that are not powers of two)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from actors import dump_checks
from actors.calibration_result import Calibration
from actors.dump_checks import DumpMismatch, _first_non_finite_row, check_dump
from actors.planned_sample import PlannedSample
from hsx_store.format import Manifest
from hsx_store.fp8 import quantize_rows, scale_name
from hsx_store.images import SampleImage
from tests.helpers import synthetic
from tests.helpers.synthetic import NUM_AUX, H


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


def fp8_dump(p: int = 4) -> tuple[dict[str, torch.Tensor], dict, Manifest]:
    """A dump as a quantizing server publishes it, for the synthetic FP8 store's manifest."""
    m = synthetic.manifest("fp8_e4m3")
    g = torch.Generator().manual_seed(0)
    aux, final = (torch.randn(p, *rows, generator=g).bfloat16() for rows in ((NUM_AUX, H), (H,)))
    tensors = {"input_ids": torch.arange(p)}
    for name, x in (("aux_hidden_states", aux), ("final_hidden_states", final)):
        tensors[name], tensors[scale_name(name)] = quantize_rows(x)
    meta = {"rid": "r", "index": 7, "dp_rank": None, "layer_ids": m.layer_ids}
    return tensors, meta | {"quantized": "fp8_e4m3"}, m


def check(tensors: dict[str, torch.Tensor], meta: dict, m: Manifest) -> None:
    check_dump(
        tensors,
        meta,
        rid="r",
        sample=PlannedSample(np.arange(len(tensors["input_ids"]))),
        cached_tokens=0,
        manifest=m,
        calibration=Calibration(offset=0, probe_tokens=5, seconds=0.1),
    )


def test_a_quantized_dump_passes_and_its_nan_bits_and_bad_scales_are_refused() -> None:
    tensors, meta, m = fp8_dump()
    check(tensors, meta, m)  # valid
    bad = dict(tensors, final_hidden_states=tensors["final_hidden_states"].clone())
    bad["final_hidden_states"].view(torch.uint8)[2, 5] = 0x7F  # e4m3 NaN
    with pytest.raises(DumpMismatch, match=r"final_hidden_states has NaN .* from token 2"):
        check(bad, meta, m)
    bad = dict(tensors, aux_hidden_states_scale=tensors["aux_hidden_states_scale"].clone())
    bad["aux_hidden_states_scale"][1, 2] = 3.0
    with pytest.raises(DumpMismatch, match="aux_hidden_states_scale at token 1 is not 0 or a"):
        check(bad, meta, m)
    no_scale = {k: v for k, v in tensors.items() if k != "final_hidden_states_scale"}
    with pytest.raises(DumpMismatch, match="the dump has no final_hidden_states_scale"):
        check(no_scale, meta, m)


def test_quantized_rows_for_a_bf16_store_and_unquantized_rows_of_another_dtype_fail() -> None:
    tensors, meta, m = fp8_dump()
    with pytest.raises(DumpMismatch, match="quantized as fp8_e4m3, the store keeps bfloat16"):
        check(tensors, meta, synthetic.manifest("bfloat16"))
    served = {"input_ids": tensors["input_ids"]}
    served["aux_hidden_states"] = torch.zeros(4, NUM_AUX, H, dtype=torch.bfloat16)
    served["final_hidden_states"] = torch.zeros(4, H, dtype=torch.float32)
    with pytest.raises(DumpMismatch, match=r"final_hidden_states is torch\.float32, expected"):
        check(served, meta | {"quantized": None}, m)  # an FP8 store quantizes bf16 rows


def image_dump() -> tuple[dict[str, torch.Tensor], PlannedSample]:
    """A float32 dump of 8 rows with one image at rows 2-5 (image token 12): SGLang's pad
    values there, M-RoPE positions as planned."""
    image = SampleImage("ab" * 32, start=2, length=4, grid_thw=(1, 4, 4))
    planned = np.array([1, 9, 12, 12, 12, 12, 10, 3], np.int32)
    positions = np.array(
        [[0, 0, 0], [1, 1, 1], [2, 2, 2], [2, 2, 3], [2, 3, 2], [2, 3, 3], [4, 4, 4], [5, 5, 5]],
        np.int32,
    )
    dumped = torch.tensor([1, 9, 7 << 58, 5 << 57, 3 << 59, 7 << 58, 10, 3])
    tensors = {
        "input_ids": dumped,
        "mrope_positions": torch.from_numpy(positions.astype(np.int64)),
        "aux_hidden_states": torch.zeros(8, NUM_AUX, H),
        "final_hidden_states": torch.zeros(8, H),
    }
    return tensors, PlannedSample(planned, (image,), None, positions, 12)


def check_image_dump(tensors: dict[str, torch.Tensor], sample: PlannedSample) -> None:
    m = synthetic.manifest("float32")
    check_dump(
        tensors,
        {"rid": "r", "index": 7, "dp_rank": None, "layer_ids": m.layer_ids},
        rid="r",
        sample=sample,
        cached_tokens=0,
        manifest=m,
        calibration=Calibration(offset=0, probe_tokens=5, seconds=0.1),
    )


def test_an_image_dump_passes_with_pad_values_in_its_span_and_is_refused_otherwise() -> None:
    tensors, sample = image_dump()
    check_image_dump(tensors, sample)
    unexpanded = dict(tensors, input_ids=torch.from_numpy(sample.input_ids.astype(np.int64)))
    with pytest.raises(DumpMismatch, match="row 2 holds the image token itself"):
        check_image_dump(unexpanded, sample)
    shifted = dict(tensors, input_ids=tensors["input_ids"].roll(1))
    with pytest.raises(DumpMismatch, match="token ids differ from the plan from position 0"):
        check_image_dump(shifted, sample)
    wrong_text = dict(tensors, input_ids=tensors["input_ids"].clone())
    wrong_text["input_ids"][6] = 11  # <|vision_end|> changed: outside the span
    with pytest.raises(DumpMismatch, match="from position 6"):
        check_image_dump(wrong_text, sample)


def test_m_rope_positions_must_be_the_planned_ones() -> None:
    tensors, sample = image_dump()
    moved = dict(tensors, mrope_positions=tensors["mrope_positions"].clone())
    moved["mrope_positions"][4, 1] += 1
    with pytest.raises(DumpMismatch, match="M-RoPE positions differ from the plan from row 4"):
        check_image_dump(moved, sample)
    with pytest.raises(DumpMismatch, match="no mrope_positions"):
        check_image_dump({k: v for k, v in tensors.items() if k != "mrope_positions"}, sample)
    flat = dict(tensors, mrope_positions=tensors["mrope_positions"][:, 0])
    with pytest.raises(DumpMismatch, match="shape"):
        check_image_dump(flat, sample)
