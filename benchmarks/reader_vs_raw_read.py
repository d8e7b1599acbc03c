"""The training reader vs a plain sequential read of the same bytes, from the same disk.

Baseline: every chunk file of the hidden arrays read in order with one plain `readinto` each,
into four page-aligned buffers in turn. Measured: HiddenStatesIterable yielding every visible
sample as bf16 tensors, one process, one epoch per round. Both read warm files; GB/s over the
hidden-state payload; rounds alternate (benchmarks/rounds.py), value = median of per-round
ratios. The store is written first by the real ShardWriter, Kimi-shaped bf16 rows (~2.6 GB).

    make bench BENCH=reader_vs_raw_read

Why four page-aligned buffers, what limits both, the figures: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from actors.shard_writer import ShardWriter
from benchmarks.rounds import alternate
from benchmarks.writer_vs_tofile import make_samples
from hsx_store.buffers import page_aligned_empty
from hsx_store.builder import create_store
from hsx_store.format import DEFAULT_CODEC, Manifest, make_manifest
from hsx_store.reader import HiddenStatesIterable

TARGET = 0.8


def stand_in_manifest(
    root: Path, num_aux: int, hidden: int, max_length: int, samples_per_shard: int
) -> Manifest:
    """A manifest made as the driver makes one, from stand-in model files under `root`."""
    model = root / "model"
    model.mkdir(exist_ok=True)
    for name in ("config.json", "tokenizer.json", "model.safetensors"):
        (model / name).write_text("{}")
    capture = {
        "layer_ids": list(range(num_aux)),
        "layer_convention": "bench",
        "hidden_size": hidden,
        "num_aux": num_aux,
        "dtype": "bfloat16",
    }
    return make_manifest(
        "bench",
        model,
        capture,
        max_length=max_length,
        samples_per_shard=samples_per_shard,
        codec=DEFAULT_CODEC,
        prenorm=False,  # the rows SpecForge's format holds: aux + the post-norm state
    )


def build_store(
    root: Path,
    samples: int,
    num_aux: int,
    hidden: int,
    url: str | None = None,
    storage_options: dict[str, Any] | None = None,
) -> tuple[str, int]:
    """A committed store of random bf16 rows, written by the real ShardWriter at `url`
    (default: under `root`, which also holds the stand-in model files); returns its URL and
    the hidden-state bytes."""
    rows = make_samples(samples, 256, 2048, num_aux, hidden)
    manifest = stand_in_manifest(root, num_aux, hidden, max_length=4096, samples_per_shard=16)
    url = url or str(root / "s.zarr")
    ids = [np.arange(1, len(a) + 1, dtype=np.int32) for a, _ in rows]  # nonzero: stored
    masks = [np.ones(len(a), np.uint8) for a, _ in rows]
    names = [f"s{i}" for i in range(samples)]
    store = create_store(url, manifest, names, ids, masks, storage_options=storage_options)
    for sh in store.shards:
        writer = ShardWriter(store, sh)
        for i in range(sh.sample_begin, sh.sample_end):
            writer.write_sample(i, *rows[i])
        writer.commit({})
    return url, sum(a.nbytes + f.nbytes for a, f in rows)


def chunk_files(url: str) -> list[Path]:
    return sorted(
        p
        for name in ("aux_hidden_states", "final_hidden_states")
        for p in (Path(url) / name / "c").rglob("*")
        if p.is_file()
    )


def raw_read_seconds(files: list[Path], buffers: list[np.ndarray]) -> float:
    start = time.perf_counter()
    for k, path in enumerate(files):
        out = memoryview(buffers[k % len(buffers)])
        with path.open("rb", buffering=0) as f:
            f.readinto(out[: path.stat().st_size])
    return time.perf_counter() - start


def reader_seconds(reader: HiddenStatesIterable) -> float:
    """One epoch: the reader is built once, as a training loop builds it (its store handle and
    read buffers then carry over), like the file list the raw read is given."""
    start = time.perf_counter()
    for sample in reader:
        sample["aux_hidden_states"].sum  # noqa: B018 - the tensors exist; nothing is converted
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=40)
    parser.add_argument("--num-aux", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--rounds", type=int, default=21)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=os.getcwd(), prefix=".bench-reader-") as tmp:
        url, payload = build_store(Path(tmp), args.samples, args.num_aux, args.hidden)
        files = chunk_files(url)
        stored = sum(p.stat().st_size for p in files)
        print(
            f"store: {args.samples} samples, {payload / 1e9:.2f} GB of hidden states in "
            f"{len(files)} chunk files ({stored / 1e9:.2f} GB)"
        )
        reader = HiddenStatesIterable(url)
        largest = max(p.stat().st_size for p in files)
        buffers = [page_aligned_empty((largest,), np.dtype(np.uint8)) for _ in range(4)]
        raw_read_seconds(files, buffers)  # warm the page cache (and both sides' memory)
        reader_seconds(reader)
        rounds = alternate(
            baseline=lambda: payload / raw_read_seconds(files, buffers) / 1e9,
            measured=lambda: payload / reader_seconds(reader) / 1e9,
            rounds=args.rounds,
        )
    rounds.show("GB/s", baseline="raw readinto", measured="HiddenStatesIterable")
    print(rounds.result_line("reader_vs_raw_read", TARGET))


if __name__ == "__main__":
    main()
