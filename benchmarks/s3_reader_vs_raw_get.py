"""The training reader on object storage vs plain concurrent GETs of the same chunk objects.

Baseline: every chunk object the reader needs, fetched whole with obstore's async GET on zarr's
event loop, at most `CONCURRENCY` at a time (the reader's limit), each held until the round
ends. Measured: HiddenStatesIterable over the same s3:// store, one process, every visible
sample as bf16 tensors. Each round's ratio is GET seconds / reader seconds; rounds alternate
(benchmarks/rounds.py). The store is written by the ShardWriter to a loopback S3 server (moto,
credentials enforced: tools/s3_server.py), Kimi-ish rows, ~0.5 GB; moto sets the absolute GB/s.

    .venv/bin/python -m benchmarks.s3_reader_vs_raw_get

Details and figures: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path
from typing import Any

import obstore
from zarr.core.sync import sync

from benchmarks.reader_vs_raw_read import build_store
from benchmarks.rounds import alternate
from hsx_store.format import HIDDEN_ARRAYS
from hsx_store.location import open_location
from hsx_store.object_rows import CONCURRENCY
from hsx_store.reader import PLAN_ARRAYS, HiddenStatesIterable
from tools.s3_server import s3_server

TARGET = 0.8


def chunk_keys(backend: Any) -> list[tuple[str, int]]:
    """(key, size) of every chunk object of the token-major arrays, in key order."""
    found = [
        (meta["path"], meta["size"])
        for name in (*PLAN_ARRAYS, *HIDDEN_ARRAYS)  # absent arrays list nothing
        for batch in obstore.list(backend, prefix=f"{name}/c/")
        for meta in batch
    ]
    return sorted(found)


async def get_all(backend: Any, keys: list[str], concurrency: int) -> list[Any]:
    gets = asyncio.Semaphore(concurrency)

    async def get(key: str) -> Any:
        async with gets:
            result = await obstore.get_async(backend, key)
            return await result.bytes_async()

    return await asyncio.gather(*(get(key) for key in keys))


def get_seconds(backend: Any, keys: list[str], nbytes: int) -> float:
    start = time.perf_counter()
    held = sync(get_all(backend, keys, CONCURRENCY))  # zarr's event loop, as the reader's
    seconds = time.perf_counter() - start
    assert sum(len(b) for b in held) == nbytes
    return seconds


def reader_seconds(reader: HiddenStatesIterable, samples: int) -> float:
    start = time.perf_counter()
    count = 0
    for sample in reader:
        sample["aux_hidden_states"].sum  # noqa: B018 - the tensors exist; nothing is converted
        count += 1
    seconds = time.perf_counter() - start
    assert count == samples
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--num-aux", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    with s3_server() as s3, tempfile.TemporaryDirectory(prefix=".bench-s3-reader-") as tmp:
        url = s3.url("bench.zarr")
        start = time.perf_counter()
        _, payload = build_store(
            Path(tmp), args.samples, args.num_aux, args.hidden, url, s3.options
        )
        print(f"store written to {url} in {time.perf_counter() - start:.1f} s")
        backend = open_location(url, s3.options, read_only=True).store
        objects = chunk_keys(backend)
        keys, nbytes = [k for k, _ in objects], sum(size for _, size in objects)
        print(
            f"{args.samples} samples, {payload / 1e9:.2f} GB of hidden states in "
            f"{len(keys)} chunk objects ({nbytes / 1e9:.2f} GB), {CONCURRENCY} GETs at a time"
        )
        reader = HiddenStatesIterable(url, storage_options=s3.options)
        get_seconds(backend, keys, nbytes)  # warm both sides: connections, the reader's buffers
        reader_seconds(reader, args.samples)
        rounds = alternate(
            baseline=lambda: nbytes / get_seconds(backend, keys, nbytes) / 1e9,
            measured=lambda: nbytes / reader_seconds(reader, args.samples) / 1e9,
            rounds=args.rounds,
        )
    rounds.show("GB/s", baseline="concurrent GETs", measured="HiddenStatesIterable")
    print(rounds.result_line("s3_reader_vs_raw_get", TARGET))


if __name__ == "__main__":
    main()
