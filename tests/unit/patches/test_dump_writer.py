"""Tests for patches/dump_writer.py and its dump_files and host_regions modules (CPU always; CUDA
tests skip without a GPU)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from hsx_store.fp8 import quantize, quantize_rows
from patches import dump_files as df
from patches import dump_writer as dw
from patches import host_regions
from patches.dump_files import read_dump, release_dump
from patches.dump_writer import DumpWriter


def _rand(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    if dtype.is_floating_point:
        return torch.randn(shape).to(dtype)
    return torch.randint(-(2**40), 2**40, shape, dtype=dtype)


def _entries(root: Path) -> list[str]:
    """Directory entries other than the pool's preallocated files (private, dot-prefixed)."""
    return sorted(p for p in os.listdir(root) if not p.startswith(".pool-"))


@pytest.fixture
def writer(tmp_path: Path):
    w = DumpWriter(tmp_path / "dumps", device="cpu")
    yield w
    w.close(timeout=30)


def test_round_trip_dtypes_bit_exact(writer: DumpWriter) -> None:
    src = {
        "ids": _rand((5,), torch.int64),
        "final": _rand((5, 7), torch.float32),
        "aux": _rand((5, 3, 4), torch.bfloat16),
        "empty": torch.empty((0, 7), dtype=torch.bfloat16),
        "odd": _rand((3,), torch.float16),
        "mask": torch.tensor([True, False, True]),
    }
    pd = writer.open("r1", {k: (tuple(v.shape), v.dtype) for k, v in src.items()}, {"rid": "r1"})
    assert pd.path == writer.root / "r1" and not pd.path.exists()
    for k, v in src.items():
        pd.fill(k, 0, v)
    pd.publish({"n": 5})
    writer.flush(timeout=30)
    assert writer.pending_bytes == 0

    loaded = load_file(pd.path / "tensors.safetensors")  # stock safetensors
    tensors, meta = read_dump(pd.path)
    for got in (loaded, tensors):
        assert got.keys() == src.keys()
        for k, v in src.items():
            assert got[k].dtype == v.dtype and got[k].shape == v.shape
            assert torch.equal(got[k].view(torch.uint8), v.contiguous().view(torch.uint8)), k
    with safe_open(pd.path / "tensors.safetensors", framework="pt") as f:
        assert f.metadata() is None
        assert torch.equal(f.get_tensor("ids"), src["ids"])
    assert meta["rid"] == "r1" and meta["n"] == 5
    assert meta["tensors"]["aux"] == {"shape": [5, 3, 4], "dtype": "bfloat16"}
    assert meta["tensors"]["empty"] == {"shape": [0, 7], "dtype": "bfloat16"}
    assert json.loads((pd.path / "meta.json").read_text()) == meta
    # exact size: header (page-padded) + data, nothing after
    size = (pd.path / "tensors.safetensors").stat().st_size
    hlen = int.from_bytes((pd.path / "tensors.safetensors").read_bytes()[:8], "little")
    assert hlen % 8 == 0
    assert size == 8 + hlen + sum(v.numel() * v.element_size() for v in src.values())


def test_fragments_out_of_order_and_overwrite(writer: DumpWriter) -> None:
    full = _rand((10, 6), torch.bfloat16)
    pd = writer.open("chunked", {"h": ((10, 6), torch.bfloat16)}, {})
    pd.fill("h", 6, full[6:])
    pd.fill("h", 0, torch.zeros(4, 6, dtype=torch.bfloat16))  # overwritten below
    pd.fill("h", 3, full[3:6])
    pd.fill("h", 0, full[:4])  # re-prefill of rows 0..3 overwrites
    pd.publish()
    writer.flush(timeout=30)
    tensors, _ = read_dump(pd.path)
    assert torch.equal(tensors["h"].view(torch.uint8), full.view(torch.uint8))


def test_misaligned_layout_rejected(writer: DumpWriter) -> None:
    with pytest.raises(ValueError, match="itemsize"):
        writer.open("m", {"a": ((3,), torch.float16), "b": ((1,), torch.int64)}, {})
    assert writer.pending_bytes == 0


def test_fill_rejects_bad_shapes(writer: DumpWriter) -> None:
    pd = writer.open("bad", {"h": ((4, 2), torch.float32)}, {})
    with pytest.raises(ValueError):
        pd.fill("h", 3, torch.zeros(2, 2))  # past the end
    with pytest.raises(ValueError):
        pd.fill("h", 0, torch.zeros(2, 2, dtype=torch.float64))
    pd.abort()


def test_reader_never_sees_partial_dump(tmp_path: Path, monkeypatch) -> None:
    root = tmp_path / "dumps"
    writer = DumpWriter(root, device="cpu")
    finish = dw.PendingDump._finish
    in_finish = threading.Event()
    release = threading.Event()

    def slow_finish(self: dw.PendingDump) -> None:
        in_finish.set()
        release.wait(10)
        finish(self)

    monkeypatch.setattr(dw.PendingDump, "_finish", slow_finish)
    pd = writer.open("r", {"a": ((64, 64), torch.float32)}, {"x": 1})
    pd.fill("a", 0, torch.ones(64, 64))
    assert _entries(root) == [".tmp-r"]  # tmp dirs are dot-prefixed
    pd.publish()
    assert in_finish.wait(10)
    assert [p for p in os.listdir(root) if not p.startswith(".")] == []

    seen: list[set[str]] = []
    stop = threading.Event()

    def poll() -> None:
        while not stop.is_set():
            for p in os.listdir(root):
                if not p.startswith("."):
                    with contextlib.suppress(FileNotFoundError):
                        seen.append(set(os.listdir(root / p)))

    t = threading.Thread(target=poll)
    t.start()
    release.set()
    writer.flush(timeout=30)
    stop.set()
    t.join()
    assert all(s == {"tensors.safetensors", "meta.json"} for s in seen)
    assert _entries(root) == ["r"]
    tensors, meta = read_dump(root / "r")
    assert meta["x"] == 1 and torch.equal(tensors["a"], torch.ones(64, 64))
    writer.close()


def test_back_pressure_blocks_until_published(tmp_path: Path, monkeypatch) -> None:
    one = 256 * 1024 * 4 + 4096  # bytes of one dump (data + page-padded header)
    writer = DumpWriter(tmp_path / "d", max_pending_bytes=2 * one + 16, device="cpu")
    finish = dw.PendingDump._finish
    gate = threading.Semaphore(0)  # the publisher publishes one dump per release()
    peak = [0]

    def gated_finish(self: dw.PendingDump) -> None:
        peak[0] = max(peak[0], writer.pending_bytes)
        assert gate.acquire(timeout=30)
        finish(self)

    monkeypatch.setattr(dw.PendingDump, "_finish", gated_finish)
    spec = {"a": ((256, 1024), torch.float32)}
    opened: list[int] = []

    def producer() -> None:
        for i in range(6):
            pd = writer.open(f"d{i}", spec, {})
            peak[0] = max(peak[0], writer.pending_bytes)
            opened.append(i)
            pd.fill("a", 0, torch.full((256, 1024), float(i)))
            pd.publish()

    t = threading.Thread(target=producer)
    t.start()
    for published in range(6):
        # Exactly two dumps fit under the bound: open() of the next one blocks until a publish.
        deadline = time.monotonic() + 10
        while len(opened) < min(published + 2, 6) and time.monotonic() < deadline:
            time.sleep(0.005)
        time.sleep(0.05)
        assert len(opened) == min(published + 2, 6)
        gate.release()
    t.join(10)
    writer.flush(timeout=30)
    assert peak[0] <= writer.max_pending_bytes
    assert writer.pending_bytes == 0
    for i in range(6):
        assert read_dump(writer.root / f"d{i}")[0]["a"][0, 0].item() == float(i)
    writer.close()


def test_oversized_dump_proceeds_alone(tmp_path: Path) -> None:
    writer = DumpWriter(tmp_path / "d", max_pending_bytes=1024, device="cpu")
    pd = writer.open("big", {"a": ((1000,), torch.float32)}, {})
    assert writer.pending_bytes > writer.max_pending_bytes
    done = threading.Event()

    def second() -> None:
        writer.open("small", {"a": ((1,), torch.float32)}, {}).publish()
        done.set()

    t = threading.Thread(target=second)
    t.start()
    assert not done.wait(0.2)  # blocked behind the oversized one
    pd.publish()
    assert done.wait(10)
    t.join()
    writer.close(timeout=30)
    assert sorted(os.listdir(writer.root)) == ["big", "small"]


def test_abort_frees_bytes(writer: DumpWriter) -> None:
    pd = writer.open("gone", {"a": ((128, 128), torch.float32)}, {})
    pd.fill("a", 0, torch.ones(128, 128))
    assert writer.pending_bytes > 128 * 128 * 4
    pd.abort()
    writer.flush(timeout=30)
    assert writer.pending_bytes == 0
    assert _entries(writer.root) == []
    with pytest.raises(RuntimeError):
        pd.publish()


def test_background_error_surfaces(writer: DumpWriter, monkeypatch) -> None:
    def boom(self: dw.PendingDump) -> None:
        raise OSError("disk on fire")

    monkeypatch.setattr(dw.PendingDump, "_finish", boom)
    pd = writer.open("e", {"a": ((4,), torch.float32)}, {})
    pd.publish()
    with pytest.raises(RuntimeError, match="background") as ei:
        writer.flush(timeout=30)
    assert isinstance(ei.value.__cause__, OSError)
    assert writer.pending_bytes == 0 and _entries(writer.root) == []
    monkeypatch.undo()
    writer.open("ok", {"a": ((4,), torch.float32)}, {}).publish()  # error was reported once
    writer.flush(timeout=30)


def test_background_error_surfaces_in_open(writer: DumpWriter, monkeypatch) -> None:
    monkeypatch.setattr(dw.PendingDump, "_finish", lambda self: 1 / 0)
    writer.open("e", {"a": ((4,), torch.float32)}, {}).publish()
    deadline = time.monotonic() + 10
    while writer.pending_bytes and time.monotonic() < deadline:
        time.sleep(0.01)
    with pytest.raises(RuntimeError):
        writer.open("next", {"a": ((4,), torch.float32)}, {})


def test_name_checks(writer: DumpWriter) -> None:
    for bad in ("", ".hidden", "a/b", ".."):
        with pytest.raises(ValueError):
            writer.open(bad, {}, {})
    writer.open("x", {}, {}).publish()
    writer.flush(timeout=30)
    with pytest.raises(FileExistsError):
        writer.open("x", {}, {})


def test_pool_files_grow_and_are_reused(tmp_path: Path) -> None:
    w = DumpWriter(tmp_path / "d", device="cpu", pool=2, pool_threads=2, copy_threads=3)
    sizes = [100, 100, 100, 3000, 3000, 50, 3000, 100]  # grows, then smaller dumps reuse files
    expect = {}
    for i, n in enumerate(sizes):
        x = torch.randn(n, 64)
        pd = w.open(f"p{i}", {"x": ((n, 64), torch.float32)}, {})
        pd.fill("x", 0, x)
        pd.publish()
        expect[f"p{i}"] = x
        if i % 3 == 0:
            w.flush(timeout=30)
    w.close(timeout=30)
    assert sorted(os.listdir(w.root)) == sorted(expect)  # no tmp or pool entries left
    for name, x in expect.items():
        got = load_file(w.root / name / "tensors.safetensors")["x"]
        assert torch.equal(got, x)


def test_unfilled_rows_are_zero_despite_reused_staging(writer: DumpWriter) -> None:
    for i in range(3):  # staging buffers are reused: garbage must not leak into unfilled rows
        pd = writer.open(f"u{i}", {"x": ((8, 4), torch.float32)}, {})
        if i == 0:
            pd.fill("x", 0, torch.full((8, 4), 7.0))
        else:
            pd.fill("x", 2, torch.ones(3, 4))
        pd.publish()
        writer.flush(timeout=30)
    x = read_dump(writer.root / "u2")[0]["x"]
    assert torch.equal(x[2:5], torch.ones(3, 4))
    assert not x[:2].any() and not x[5:].any()


@pytest.fixture
def shm_path(tmp_path: Path):
    """cudaHostRegister needs a tmpfs mapping, as in production (/dev/shm)."""
    if not os.path.isdir("/dev/shm"):
        yield tmp_path
        return
    d = Path(tempfile.mkdtemp(dir="/dev/shm", prefix="test_dump_writer-"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _cuda_round_trip(tmp_path: Path, busy: bool, pool: int) -> None:
    torch.manual_seed(0)
    writer = DumpWriter(tmp_path / "d", pool=pool)
    assert writer.pin
    assert writer.ring == (str(tmp_path).startswith("/dev/shm"))
    n, h = 1024, 512
    expect = []
    stop = threading.Event()
    mm_stream = torch.cuda.Stream()
    if busy:  # a concurrently running matmul stream
        a = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)

        def spin() -> None:
            with torch.cuda.stream(mm_stream):
                while not stop.is_set():
                    for _ in range(8):
                        a @ a
                    mm_stream.synchronize()

        t = threading.Thread(target=spin)
        t.start()
    try:
        for i in range(6):
            aux = torch.randn(n, 3 * h, device="cuda").to(torch.bfloat16)
            final = torch.randn(n, h, device="cuda").to(torch.bfloat16)
            pd = writer.open(
                f"c{i}",
                {
                    "aux": ((n, 3 * h), torch.bfloat16),
                    "final": ((n, h), torch.bfloat16),
                },
                {"i": i},
            )
            # chunked: two fragments, the second first; the source is freed right away
            pd.fill("aux", 512, aux[512:] * 1)
            pd.fill("aux", 0, aux[:512])
            pd.fill("final", 0, final)
            pd.publish()
            expect.append((aux.cpu(), final.cpu()))
            del aux, final
        writer.flush(timeout=60)
    finally:
        stop.set()
        if busy:
            t.join()
        writer.close(timeout=60)
    for i, (aux, final) in enumerate(expect):
        tensors, meta = read_dump(writer.root / f"c{i}")
        assert meta["i"] == i
        assert torch.equal(tensors["aux"].view(torch.int16), aux.view(torch.int16))
        assert torch.equal(tensors["final"].view(torch.int16), final.view(torch.int16))
    assert not [p for p in os.listdir(writer.root) if p.startswith(".")]


@pytest.mark.parametrize("pool", [0, 2])
def test_cuda_fill_bit_exact(shm_path: Path, pool: int, cuda_device: torch.device) -> None:
    _cuda_round_trip(shm_path, busy=False, pool=pool)


def test_cuda_fill_bit_exact_with_concurrent_matmul(
    shm_path: Path, cuda_device: torch.device
) -> None:
    _cuda_round_trip(shm_path, busy=True, pool=2)


def test_cuda_fill_waits_for_producer(shm_path: Path, cuda_device: torch.device) -> None:
    # The rows are produced by a slow kernel on the current stream right before fill(): the side
    # stream must wait for it rather than copy stale memory.
    writer = DumpWriter(shm_path / "d", pool=0)
    x = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    y = x
    for _ in range(20):
        y = (y @ x) * 0.01
    pd = writer.open("p", {"y": ((4096, 4096), torch.bfloat16)}, {})
    pd.fill("y", 0, y)
    pd.publish()
    writer.close(timeout=60)
    assert torch.equal(read_dump(writer.root / "p")[0]["y"], y.cpu())


def _quantized_round_trip(writer: DumpWriter, x: torch.Tensor) -> None:
    """x [P, 3, H] through fill_converted with the server's quantizer, in two fragments (the
    second first), against the CPU quantizer's bytes: the store's bytes either way."""
    p, h = x.shape[0], x.shape[-1]
    specs = {"s": ((p, 3), torch.float32), "v": ((p, 3, h), torch.float8_e4m3fn)}
    pd = writer.open("q", specs, {})
    half = p // 2
    pd.fill_converted(("v", "s"), half, x[half:] * 1, quantize_rows)  # a temporary source
    pd.fill_converted(("v", "s"), 0, x[:half], quantize_rows)
    pd.publish()
    writer.flush(timeout=60)
    tensors, _ = read_dump(writer.root / "q")
    bits, scales = quantize(x.cpu(), "x")
    assert torch.equal(tensors["v"].view(torch.uint8), torch.from_numpy(bits))
    assert torch.equal(tensors["s"], torch.from_numpy(scales))
    bad = writer.open("bad", specs, {})
    with pytest.raises(ValueError, match="v: rows from 0"):  # the wrong shape is refused
        bad.fill_converted(("v", "s"), 0, x[:, :2], quantize_rows)
    bad.abort()


def _quantizer_rows(p: int, h: int) -> torch.Tensor:
    """[p, 3, h] bf16 rows over ~12 decades, with bf16's largest and a subnormal-only row."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(p, 3, h, generator=g) * 10.0 ** torch.empty(p, 3, 1).uniform_(
        -6, 6, generator=g
    )
    x[0, 0, :2] = torch.tensor([torch.finfo(torch.bfloat16).max, -1.0])
    x[1, 1] = torch.randn(h, generator=g) * 2**-130
    return x.to(torch.bfloat16)


def test_fill_converted_quantizes_to_the_cpu_quantizers_bytes(writer: DumpWriter) -> None:
    _quantized_round_trip(writer, _quantizer_rows(64, 96))


def test_cuda_fill_converted_quantizes_on_the_side_stream_to_the_cpu_quantizers_bytes(
    shm_path: Path, cuda_device: torch.device
) -> None:
    """On the GPU, behind a slow producer: the same bytes as the CPU quantizer."""
    writer = DumpWriter(shm_path / "d", pool=0)
    try:
        x = _quantizer_rows(4096, 512).cuda()
        a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
        for _ in range(10):  # queued ahead on the current stream: the side stream must wait
            a = (a @ a) * 1e-3
        x = x + (a[:1, :1] * 0).to(x.dtype)  # produced after the matmuls
        _quantized_round_trip(writer, x)
    finally:
        writer.close(timeout=60)


@pytest.fixture(params=["fake", pytest.param("cuda", marks=pytest.mark.cuda)])
def ring_mode(request, monkeypatch):
    """ "fake": the ring on CPU with registration stubbed out (runs everywhere); "cuda": real."""
    if request.param == "cuda":
        request.getfixturevalue("cuda_device")  # skips without CUDA
        return "cuda"
    monkeypatch.setattr(host_regions, "cuda_register", lambda ptr, n: True)
    monkeypatch.setattr(host_regions, "cuda_unregister", lambda ptr: None)
    return "fake"


def _ring_writer(shm_path: Path, mode: str, **kw) -> DumpWriter:
    w = DumpWriter(shm_path / "d", device="cuda" if mode == "cuda" else "cpu", ring=True, **kw)
    assert w.ring
    return w


def _src(x: torch.Tensor, mode: str) -> torch.Tensor:
    return x.cuda() if mode == "cuda" else x


def _ino(dump: Path) -> int:
    return os.stat(dump / "tensors.safetensors").st_ino


def _wait(pred, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_ring_release_reuses_region(shm_path: Path, ring_mode: str) -> None:
    w = _ring_writer(shm_path, ring_mode, pool=0)
    spec = {"ids": ((6,), torch.int64), "h": ((6, 8), torch.bfloat16)}
    ids, h = torch.arange(6), torch.randn(6, 8).to(torch.bfloat16)
    pd = w.open("a", spec, {"k": 1})
    pd.fill("ids", 0, ids)
    pd.fill("h", 0, _src(h, ring_mode))
    pd.publish()
    w.flush(timeout=30)
    a = w.root / "a"
    st = os.stat(a / "tensors.safetensors")
    assert st.st_size == w.pending_bytes == w.ring_stats()["bytes"]  # the whole region
    # stock safetensors accepts the padded file; read_dump hides the padding
    loaded = load_file(a / "tensors.safetensors")
    assert set(loaded) == {"ids", "h", df.PAD_KEY} and loaded[df.PAD_KEY].dtype == torch.uint8
    with safe_open(a / "tensors.safetensors", framework="pt") as f:
        assert torch.equal(f.get_tensor("ids"), ids)
    tensors, meta = read_dump(a)
    assert set(tensors) == {"ids", "h"} and df.PAD_KEY not in meta["tensors"]
    assert torch.equal(tensors["h"].view(torch.int16), h.view(torch.int16))
    del tensors, loaded

    release_dump(a)
    assert not a.exists()
    with pytest.raises(FileNotFoundError):
        read_dump(a)
    _wait(lambda: w.ring_stats()["released"] == 1)
    assert w.pending_bytes == 0

    # the next dump takes the same region (same inode); rows it does not fill read as zero
    h2 = torch.randn(4, 8).to(torch.bfloat16)
    pd = w.open("b", spec, {})
    pd.fill("ids", 0, torch.arange(6) * 2)
    pd.fill("h", 1, _src(h2[:3], ring_mode))
    pd.publish()
    w.flush(timeout=30)
    b = w.root / "b"
    assert _ino(b) == st.st_ino and w.ring_stats()["regions"] == 1
    tensors, _ = read_dump(b)
    assert torch.equal(tensors["ids"], torch.arange(6) * 2)
    assert torch.equal(tensors["h"][1:4].view(torch.int16), h2[:3].view(torch.int16))
    assert not tensors["h"][0].any() and not tensors["h"][4:].any()
    del tensors
    w.close(timeout=30)
    # after close: no private entries, the published dump still reads, and release deletes it
    assert sorted(os.listdir(w.root)) == ["b"]
    assert read_dump(b)[1]["tensors"]["h"] == {"shape": [6, 8], "dtype": "bfloat16"}
    release_dump(b)
    assert os.listdir(w.root) == []


def test_ring_back_pressure_until_release(shm_path: Path, ring_mode: str) -> None:
    w = _ring_writer(shm_path, ring_mode, max_pending_bytes=2 << 20, region_bytes=(1 << 20) - 4096)
    spec = {"x": ((1000,), torch.float32)}
    for name in ("a", "b"):
        w.open(name, spec, {}).publish()
    w.flush(timeout=30)
    inos = {_ino(w.root / "a"), _ino(w.root / "b")}
    assert w.pending_bytes == 2 << 20 and w.ring_stats()["regions"] == 2
    got: list[dw.PendingDump] = []
    t = threading.Thread(target=lambda: got.append(w.open("c", spec, {})))
    t.start()
    time.sleep(0.3)
    assert not got  # both regions are published and unreleased: open() waits, drops nothing
    release_dump(w.root / "a")
    t.join(10)
    assert got
    got[0].fill("x", 0, torch.ones(1000))
    got[0].publish()
    w.flush(timeout=30)
    assert _ino(w.root / "c") in inos and w.ring_stats()["regions"] == 2
    assert torch.equal(read_dump(w.root / "c")[0]["x"], torch.ones(1000))
    w.close(timeout=30)


def test_ring_abort_returns_region(shm_path: Path, ring_mode: str) -> None:
    w = _ring_writer(shm_path, ring_mode, pool=0)
    pd = w.open("a", {"x": ((10,), torch.float32)}, {})
    pd.fill("x", 0, torch.ones(10))
    pd.abort()
    w.flush(timeout=30)
    assert w.pending_bytes == 0 and w.ring_stats()["free"] == 1
    assert [p for p in os.listdir(w.root) if p != df.RING_DIR] == []
    w.open("b", {"x": ((10,), torch.float32)}, {}).publish()
    w.close(timeout=30)
    assert sorted(os.listdir(w.root)) == ["b"]


def test_ring_grows_and_keeps_smaller_regions(shm_path: Path, ring_mode: str) -> None:
    w = _ring_writer(shm_path, ring_mode, pool=0, max_pending_bytes=1 << 20)
    small, big = {"x": ((1000,), torch.float32)}, {"x": ((600_000,), torch.float32)}
    for name, spec in (("s", small), ("g", big)):
        w.open(name, spec, {}).publish()
        w.flush(timeout=30)
    sizes = {os.stat(w.root / n / "tensors.safetensors").st_size for n in ("s", "g")}
    assert sizes == {1 << 20, 3 << 20}  # size classes: 1 MiB (the bound), 3 MiB (1.5 * 2**21)
    for n in ("s", "g"):
        release_dump(w.root / n)
    _wait(lambda: w.ring_stats()["free"] == 2)
    w.open("s2", small, {}).publish()  # takes the smallest region that fits
    w.flush(timeout=30)
    assert os.stat(w.root / "s2" / "tensors.safetensors").st_size == 1 << 20
    w.close(timeout=30)


def test_ring_deleted_dump_is_replaced_and_warned(
    shm_path: Path, ring_mode: str, caplog: pytest.LogCaptureFixture
) -> None:
    w = _ring_writer(shm_path, ring_mode, pool=0, max_pending_bytes=1 << 20)
    spec = {"x": ((1000,), torch.float32)}
    w.open("a", spec, {}).publish()
    w.flush(timeout=30)
    ino = _ino(w.root / "a")
    shutil.rmtree(w.root / "a")  # not release_dump: the region cannot come back
    with caplog.at_level("WARNING", logger=dw.__name__):
        pd = w.open("b", spec, {})  # the only region leaked: a replacement is made
    pd.fill("x", 0, torch.full((1000,), 3.0))
    pd.publish()
    w.flush(timeout=30)
    assert _ino(w.root / "b") != ino
    assert w.leaked_bytes == 1 << 20 and w.ring_stats()["regions"] == 1
    assert "release_dump" in caplog.text
    assert torch.equal(read_dump(w.root / "b")[0]["x"], torch.full((1000,), 3.0))
    shutil.rmtree(w.root / "b")  # leaked bytes now exceed the bound: those regions are reclaimed
    with caplog.at_level("WARNING", logger=dw.__name__):
        w.open("c", spec, {}).publish()
    w.flush(timeout=30)
    assert w.leaked_bytes == 0 and "unregistering" in caplog.text
    w.close(timeout=30)
    assert sorted(os.listdir(w.root)) == ["c"]


def test_release_dump_without_ring_deletes(writer: DumpWriter) -> None:
    pd = writer.open("a", {"x": ((4,), torch.float32)}, {})
    pd.publish()
    writer.flush(timeout=30)
    assert not writer.ring
    release_dump(writer.root / "a")
    assert _entries(writer.root) == []
    release_dump(writer.root / "a")  # already gone: no-op


def test_ring_cleans_stale_and_foreign_region_files(shm_path: Path, ring_mode: str) -> None:
    root = shm_path / "d"
    (root / df.RING_DIR).mkdir(parents=True)
    (root / df.RING_DIR / "free-stale").write_bytes(b"x")  # a dead writer's region
    w = _ring_writer(shm_path, ring_mode, pool=0)
    assert os.listdir(root / df.RING_DIR) == []
    w.open("a", {"x": ((4,), torch.float32)}, {}).publish()
    w.flush(timeout=30)
    (root / df.RING_DIR / "free-foreign").write_bytes(b"x")
    release_dump(root / "a")
    assert "free-foreign" not in os.listdir(root / df.RING_DIR)
    w.close(timeout=30)
    assert os.listdir(root) == []


CRASHING_WRITER = """
import os, signal, sys, torch
from patches.dump_writer import DumpWriter
w = DumpWriter(sys.argv[1], device="cpu")
done = w.open("done", {"a": ((64, 64), torch.float32)}, {"x": 1})
done.fill("a", 0, torch.ones(64, 64))
done.publish()
w.flush(timeout=30)
half = w.open("half", {"a": ((64, 64), torch.float32)}, {"x": 2})
half.fill("a", 0, torch.ones(32, 64))
os.kill(os.getpid(), signal.SIGKILL)  # a server dying mid-dump: no cleanup runs
"""


def test_what_a_killed_writer_never_published_is_cleared_and_its_dumps_stay(
    tmp_path: Path,
) -> None:
    root = tmp_path / "dumps"
    crashed = subprocess.run([sys.executable, "-c", CRASHING_WRITER, str(root)], timeout=120)
    assert crashed.returncode == -signal.SIGKILL
    left = sorted(os.listdir(root))
    assert ".tmp-half" in left and "done" in left, left
    assert df.clear_unpublished(root) == len(left) - 1
    assert os.listdir(root) == ["done"]  # a reader may still hold it: it stays, and reads
    tensors, meta = read_dump(root / "done")
    assert meta["x"] == 1 and torch.equal(tensors["a"], torch.ones(64, 64))
