"""FP8 (e4m3) storage: quantization bounds, zero and non-finite rows, an FP8 store written by
the shard writer and read back (dequantized and raw), verified, and exported."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from actors.shard_writer import ShardWriter
from hsx_store.export import export, read_exported, sample_path
from hsx_store.format import Store
from hsx_store.fp8 import dequantize, quantize
from hsx_store.integrity import verify_store
from hsx_store.reader import HiddenStatesDataset, HiddenStatesIterable
from tests.helpers.synthetic import LENGTHS, NUM_AUX, H, new_store

# e4m3 keeps 3 mantissa bits: a normal value's rounding error is at most 2 ** -4 relative.
# Measured on the seeded rows below (512 x 1024, magnitudes over 6 decades): per row relative
# RMS error <= 2.86% (mean 2.66%), 1 - cosine <= 4.1e-4; with a neighbour's scale, >= 100%.
MAX_VALUE_ERROR = 2**-4

MAX_ROW_ERROR, MIN_ROW_COS = 0.03, 0.9995


def rows(n: int, width: int = 1024, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    magnitude = 10.0 ** torch.empty(n, 1).uniform_(-3, 3, generator=g)
    return (torch.randn(n, width, generator=g) * magnitude).to(torch.bfloat16)


def test_round_trip_error_is_bounded_and_scales_are_powers_of_two() -> None:
    x = rows(512)
    bits, scales = quantize(x, "x")
    assert bits.dtype == np.uint8 and scales.dtype == np.float32 and scales.shape == (512,)
    assert (np.frexp(scales)[0] == 0.5).all()  # powers of two
    y, xf = dequantize(bits, scales, torch.float32), x.float()
    assert torch.equal(dequantize(bits, scales), y.to(torch.bfloat16))  # exact in bf16
    normal = xf.abs() >= torch.from_numpy(scales)[:, None] * 2**-6
    assert ((y - xf).abs() <= MAX_VALUE_ERROR * xf.abs())[normal].all()
    error = (y - xf).norm(dim=1) / xf.norm(dim=1)
    cosine = torch.nn.functional.cosine_similarity(y, xf, dim=1)
    assert error.max() <= MAX_ROW_ERROR and cosine.min() >= MIN_ROW_COS
    # The bound can fail: a row read with its neighbour's scale is off by its magnitude.
    wrong = dequantize(bits, np.roll(scales, 1), torch.float32)
    assert ((wrong - xf).norm(dim=1) / xf.norm(dim=1)).max() > MAX_ROW_ERROR


def test_zero_rows_store_scale_zero_and_non_finite_rows_are_refused() -> None:
    x = rows(6).reshape(3, 2, 1024).clone()
    x[1, 0] = 0
    bits, scales = quantize(x, "x")
    assert scales[1, 0] == 0 and not bits[1, 0].any() and scales[1, 1] > 0
    assert not dequantize(bits, scales)[1, 0].any()
    for bad in (float("nan"), float("inf"), float("-inf")):
        y = x.clone()
        y[2, 1, 7] = bad
        with pytest.raises(ValueError, match=r"sample 9 aux: non-finite value in row \(2, 1\)"):
            quantize(y, "sample 9 aux")


def bf16_rows(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    aux = rows(LENGTHS[i] * NUM_AUX, H, seed=100 + i).reshape(LENGTHS[i], NUM_AUX, H)
    return aux, rows(LENGTHS[i], H, seed=200 + i)


def fp8_store(path: Path) -> Store:
    """An FP8 store with every shard written and committed (sample 5 failed)."""
    store = new_store(path, dtype="fp8_e4m3", codec={"name": "none"})
    for k in range(len(store.shards)):
        sh = store.shards[k]
        writer = ShardWriter(store, sh)
        for i in range(sh.sample_begin, sh.sample_end):
            if i == 5:
                writer.mark_failed(i, "test")
            else:
                writer.write_sample(i, *bf16_rows(i))
        writer.commit({})
    return Store.open(path)


def test_an_fp8_store_reads_back_dequantized_and_raw_verifies_and_exports(
    tmp_path: Path,
) -> None:
    store = fp8_store(tmp_path / "s.zarr")
    g = store.group
    assert g["aux_hidden_states"].dtype == np.uint8
    assert g["aux_hidden_states_scale"].shape == (g["aux_hidden_states"].shape[0], NUM_AUX)
    assert g["final_hidden_states_scale"].chunks == (store.manifest.chunk_tokens,)
    plain = HiddenStatesDataset(str(tmp_path / "s.zarr"))
    raw = HiddenStatesIterable(str(tmp_path / "s.zarr"), fp8="raw")
    assert list(plain.sample_indices) == [i for i in range(len(LENGTHS)) if i != 5]
    for k, r in zip(range(len(plain)), raw, strict=True):
        i = int(plain.sample_indices[k])
        sample, (aux, final) = plain[k], bf16_rows(i)
        want_aux = dequantize(*quantize(aux, "aux"))
        assert sample["aux_hidden_states"].dtype == torch.bfloat16
        assert torch.equal(sample["aux_hidden_states"], want_aux.reshape(len(aux), -1))
        assert torch.equal(sample["final_hidden_states"], dequantize(*quantize(final, "f")))
        assert r["aux_hidden_states"].dtype == torch.float8_e4m3fn
        assert r["aux_hidden_states"].shape == (LENGTHS[i], NUM_AUX, H)
        bits, scales = quantize(aux, "aux")
        assert np.array_equal(r["aux_hidden_states"].view(torch.uint8).numpy(), bits)
        assert np.array_equal(r["aux_hidden_states_scale"].numpy(), scales)
        assert r["final_hidden_states_scale"].shape == (LENGTHS[i],)
    assert verify_store(tmp_path / "s.zarr", say=lambda _: None).ok

    # speculators: the stored bits and scales; read as its FP8 reader does, the reader's rows.
    out = tmp_path / "spec"
    # A post-norm-only store (new_store's): the FP8 format is what this checks.
    export(str(tmp_path / "s.zarr"), out, "speculators", allow_post_norm=True, say=lambda _: None)
    data = load_file(sample_path(out, "speculators", 2))
    assert data["hidden_states"].dtype == torch.float8_e4m3fn
    assert data["hidden_states_scales"].shape == (LENGTHS[2], NUM_AUX + 1, 1)
    back = read_exported(out, "speculators", 2)
    assert torch.equal(back["aux_hidden_states"], plain[2]["aux_hidden_states"])
    assert torch.equal(back["final_hidden_states"], plain[2]["final_hidden_states"])
    # SpecForge: bf16, dequantized.
    export(str(tmp_path / "s.zarr"), tmp_path / "sf", "specforge", say=lambda _: None)
    back = read_exported(tmp_path / "sf", "specforge", 2)
    assert torch.equal(back["aux_hidden_states"], plain[2]["aux_hidden_states"])


def test_the_verifier_names_a_bad_scale_and_an_fp8_nan(tmp_path: Path) -> None:
    store = fp8_store(tmp_path / "s.zarr")
    g = zarr_rw(tmp_path / "s.zarr")
    rows3 = store.sample_rows(3)
    g["final_hidden_states_scale"][rows3.start + 1] = np.float32(np.inf)
    rows6 = store.sample_rows(6)
    bits = np.asarray(g["aux_hidden_states"][rows6.start + 1])
    bits[1, 4] = 0x7F  # e4m3 NaN
    g["aux_hidden_states"][rows6.start + 1] = bits
    report = verify_store(tmp_path / "s.zarr", say=lambda _: None)
    messages = [f.message for f in report.findings if f.check == "values"]
    assert any("sample 3 " in m and "final_hidden_states" in m and "token 1" in m for m in messages)
    assert any("sample 6 " in m and "aux_hidden_states" in m and "token 1" in m for m in messages)
    assert not report.ok


def zarr_rw(path: Path):
    import zarr

    return zarr.open_group(str(path), mode="r+")
