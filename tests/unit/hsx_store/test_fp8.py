"""FP8 (e4m3) storage: quantization bounds over the whole bf16 range, the CPU quantizer against
the definition the server runs, zero and non-finite rows, an FP8 store written by the shard
writer (from bf16 rows and from rows the server quantized) and read back (dequantized and raw),
verified, and exported."""

from __future__ import annotations

import contextlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from actors.shard_writer import ShardWriter
from hsx_kernels import fp8_cpu
from hsx_store import fp8
from hsx_store.export.run import export, read_exported, sample_path
from hsx_store.format import Store
from hsx_store.fp8 import Fp8Rows, dequantize, invalid_rows, quantize, quantize_rows
from hsx_store.integrity import verify_store
from hsx_store.reader import HiddenStatesDataset, HiddenStatesIterable
from tests.helpers.fp8_kernel import check_variant
from tests.helpers.fp8_rows import edge_rows, every_finite_bf16, every_value_under_every_scale, rows
from tests.helpers.synthetic import LENGTHS, NUM_AUX, H, new_store

# e4m3 keeps 3 mantissa bits: a normal value's rounding error is at most 2 ** -4 relative.
# Measured on the seeded rows below (512 x 1024, magnitudes over 6 decades): per row relative
# RMS error <= 2.86% (mean 2.66%), 1 - cosine <= 4.1e-4; with a neighbour's scale, >= 100%.
MAX_VALUE_ERROR = 2**-4

MAX_ROW_ERROR, MIN_ROW_COS = 0.03, 0.9995


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


@pytest.mark.parametrize("case", ["every finite bf16", "edges", "random"])
def test_every_finite_row_round_trips_within_the_bound(case: str) -> None:
    x = {"every finite bf16": every_finite_bf16, "edges": edge_rows, "random": lambda: rows(512)}
    x = x[case]()
    bits, scales = quantize(x, "x")
    y, xf = dequantize(bits, scales, torch.float32), x.float()
    assert torch.isfinite(y).all() and torch.isfinite(dequantize(bits, scales)).all()
    bound = torch.maximum(MAX_VALUE_ERROR * xf.abs(), torch.from_numpy(scales)[:, None] * 2**-10)
    assert ((y - xf).abs() <= bound).all()
    assert not any(flags.any() for flags in invalid_rows(bits, scales))


@pytest.mark.parametrize("threads", [0, 2])
def test_the_cpu_quantizer_gives_the_bytes_of_the_definition(
    monkeypatch: pytest.MonkeyPatch, threads: int
) -> None:
    """quantize (the C kernel, rows it leaves to the definition, blocks on threads) against
    quantize_rows (the tensor ops the capture plugin runs on the GPU): every bf16 value under
    every scale, the range's ends, random rows, and float32 rows."""
    monkeypatch.setattr(fp8, "BLOCK_BYTES", 1 << 16)  # many blocks
    x = every_value_under_every_scale()
    assert torch.equal(torch.frexp(x.float().abs().amax(1)).exponent, torch.arange(-132, 129))
    small = torch.cat([edge_rows().repeat(1, 16), rows(64, 256)])
    for rows_in in (x, small, small.float()):
        with ThreadPoolExecutor(threads) if threads else contextlib.nullcontext() as pool:
            bits, scales = quantize(rows_in, "x", pool)
        values, want_scales = quantize_rows(rows_in)
        assert np.array_equal(bits, values.view(torch.uint8).numpy())
        assert np.array_equal(scales, want_scales.numpy())


@pytest.mark.parametrize("variant", fp8_cpu.variants())
def test_every_kernel_variant_this_cpu_runs_gives_the_bytes_of_the_definition(variant: str) -> None:
    """The C kernel holds a variant per x86-64 instruction set (AVX-512, AVX2, the baseline)
    and uses the fastest this CPU runs; each one it runs is checked (the checks:
    tests/helpers/fp8_kernel.py; builds by older compilers: tests/unit/test_kernel_build.py)."""
    check_variant(fp8_cpu, variant)


def test_the_definition_marks_non_finite_rows_nan() -> None:
    """The server cannot raise: a row holding inf or NaN gets a NaN scale and NaN values (the
    cast saturates inf to 448, which would hide it)."""
    x = rows(4, 16)
    x[1, 3], x[2, 0] = float("inf"), float("nan")
    values, scales = quantize_rows(x)
    assert scales[[1, 2]].isnan().all() and not scales[[0, 3]].isnan().any()
    bad_values, bad_scales = invalid_rows(values.view(torch.uint8).numpy(), scales.numpy())
    assert bad_values.tolist() == [False, True, True, False] == bad_scales.tolist()


def test_invalid_rows_names_nan_values_bad_scales_and_overflow() -> None:
    bits, scales = quantize(rows(6, 16), "x")
    assert not any(flags.any() for flags in invalid_rows(bits, scales))
    bits[1, 5] = 0xFF  # -NaN
    scales[2] = 3.0  # not a power of two
    scales[3] = -0.5
    bits[4, 0], scales[4] = 0x78, 2.0**120  # 256 * 2**120 = inf once dequantized
    bits[5, 0], scales[5] = 0x77, 2.0**120  # 240 * 2**120: the largest the quantizer stores
    bad_values, bad_scales = invalid_rows(bits, scales)
    assert bad_values.tolist() == [False, True, False, False, True, False]
    assert bad_scales.tolist() == [False, False, True, True, False, False]


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


def fp8_store(
    path: Path,
    server_quantized: bool = False,
    lent_until_written: dict[int, bool] | None = None,
    codec: dict | None = None,
    max_lent_bytes: int = 512 << 20,
) -> Store:
    """An FP8 store with every shard written and committed (sample 5 failed), from bf16 rows
    or from the same rows quantized as the server does. `lent_until_written`: for each sample,
    whether the writer still held its memory when write_sample returned."""
    store = new_store(path, dtype="fp8_e4m3", codec=codec or {"name": "none"})
    released: set[int] = set()
    for k in range(len(store.shards)):
        sh = store.shards[k]
        writer = ShardWriter(store, sh, max_lent_bytes=max_lent_bytes)
        for i in range(sh.sample_begin, sh.sample_end):
            if i == 5:
                writer.mark_failed(i, "test")
                continue
            states = bf16_rows(i)
            if server_quantized:
                states = tuple(Fp8Rows(*quantize_rows(x)) for x in states)
            writer.write_sample(i, *states, on_release=lambda i=i: released.add(i))
            if lent_until_written is not None:
                lent_until_written[i] = i not in released
        writer.commit({})
    assert released == {i for i in range(len(LENGTHS)) if i != 5}
    return Store.open(path)


@pytest.mark.parametrize("path", ["streamed", "copied out", "encoded"])
def test_the_writer_quantizes_bf16_rows_into_the_bytes_of_the_servers_rows(
    tmp_path: Path, path: str
) -> None:
    """The same rows quantized by the writer (bf16 in) or by the server's definition (Fp8Rows
    in) give the same bytes, whichever way the writer quantizes: on its write threads a block
    at a time as it writes each chunk's files (streamed); on the caller, where rows waiting on
    a neighbour are copied out to release their sample (the chunk then mixes copied-out and
    streamed rows); or into the chunk's buffer for a codec to encode. Either kind of rows is
    held until its chunks are written or copied out."""
    codec = {"name": "zstd", "level": 1} if path == "encoded" else None
    max_lent = 0 if path == "copied out" else 512 << 20
    from_bf16: dict[int, bool] = {}
    from_server: dict[int, bool] = {}
    a = fp8_store(tmp_path / "a.zarr", False, from_bf16, codec, max_lent)
    b = fp8_store(tmp_path / "b.zarr", True, from_server)
    for name in ("aux_hidden_states", "final_hidden_states"):
        for array in (name, name + "_scale"):
            assert np.array_equal(a.group[array][:], b.group[array][:]), array
    # Sample 0's chunk waits for samples 1 and 2: its rows are still lent, unless copied out.
    assert from_server[0] and from_bf16[0] == (path != "copied out")


@pytest.mark.parametrize("copied_out", [False, True])
def test_a_non_finite_bf16_row_for_an_fp8_store_fails_the_shard_naming_the_sample(
    tmp_path: Path, copied_out: bool
) -> None:
    """The worker's dump checks refuse such rows first; a writer given one anyway (quantizing on
    a write thread, or on the caller when copying rows out) names the sample and the row, and
    the shard is not committed."""
    store = new_store(tmp_path / "s.zarr", dtype="fp8_e4m3", codec={"name": "none"})
    sh = store.shards[0]
    writer = ShardWriter(store, sh, max_lent_bytes=0 if copied_out else 512 << 20)
    with pytest.raises(
        ValueError, match=r"sample 1 \(s1-é\) aux: non-finite value in row \(0, 2\);"
    ):
        for i in range(sh.sample_begin, sh.sample_end):
            aux, final = bf16_rows(i)
            if i == 1:
                aux[0, 2, 5] = float("nan")
            writer.write_sample(i, aux, final)
        writer.commit({})
    writer.abort()
    assert not store.committed().any()


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
    # A valid scale and no NaN, but 256 * 2**120 dequantizes to inf (what the quantizer wrote
    # before it saturated the top binade).
    rows8 = store.sample_rows(8)
    top = np.asarray(g["final_hidden_states"][rows8.start + 2])
    top[0] = 0x78
    g["final_hidden_states"][rows8.start + 2] = top
    g["final_hidden_states_scale"][rows8.start + 2] = np.float32(2.0**120)
    report = verify_store(tmp_path / "s.zarr", say=lambda _: None)
    messages = [f.message for f in report.findings if f.check == "values"]
    assert any("sample 3 " in m and "final_hidden_states" in m and "token 1" in m for m in messages)
    assert any("sample 6 " in m and "aux_hidden_states" in m and "token 1" in m for m in messages)
    assert any("sample 8 " in m and "final_hidden_states" in m and "token 2" in m for m in messages)
    assert not report.ok


def zarr_rw(path: Path):
    import zarr

    return zarr.open_group(str(path), mode="r+")
