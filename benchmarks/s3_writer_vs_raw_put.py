"""ShardWriter into a store on S3 vs plain single PUTs of the same objects, same client.

Both sides talk to the same loopback S3 server (tools/s3_server.py) through obstore with the
store's client settings. Baseline: one `obstore.put(..., use_multipart=False)` per chunk object
the store holds, `--threads` at a time. Measured: the ShardWriter writing the same rows into a
store on S3, commits included, `--threads` write threads. Rates over the payload bytes;
Kimi-like rows scaled to moto's memory; rounds alternate (benchmarks/rounds.py).

    .venv/bin/python -m benchmarks.s3_writer_vs_raw_put

Details and figures: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import itertools
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import obstore

from actors.shard_writer import ShardWriter
from benchmarks.rounds import alternate
from benchmarks.writer_vs_tofile import Samples, bench_manifest, make_samples, payload_bytes
from hsx_store.builder import create_store
from hsx_store.format import DEFAULT_CODEC, Manifest, Store, default_chunk_tokens, layout
from hsx_store.location import open_location
from tools.s3_server import S3Server, s3_server

TARGET = 0.8


def new_store(s3: S3Server, name: str, samples: Samples, manifest: Manifest) -> Store:
    ids = [np.zeros(len(a), np.int32) for a, _ in samples]
    masks = [np.ones(len(a), np.uint8) for a, _ in samples]
    url = s3.url(name)
    create_store(
        url, manifest, [str(i) for i in range(len(samples))], ids, masks, storage_options=s3.options
    )
    return Store.open(url, mode="r+", storage_options=s3.options)


def writer_seconds(samples: Samples, store: Store, threads: int) -> float:
    start = time.perf_counter()
    for shard in store.shards:
        writer = ShardWriter(store, shard, threads=threads)
        for i in range(shard.sample_begin, shard.sample_end):
            writer.write_sample(i, *samples[i])
        writer.commit({})
    return time.perf_counter() - start


def chunk_objects(samples: Samples, manifest: Manifest) -> list[np.ndarray]:
    """One buffer per chunk object the store holds (aux and final), filled once: the sizes
    are what matter to a PUT, and touched memory is what the writer sends from too."""
    _, _, total = layout(
        [len(a) for a, _ in samples], manifest.samples_per_shard, manifest.chunk_tokens
    )
    aux_row = manifest.num_aux * manifest.hidden_size * 2
    final_row = manifest.hidden_size * 2
    chunks = total // manifest.chunk_tokens
    return [
        np.full(manifest.chunk_tokens * row, 7, np.uint8)
        for _ in range(chunks)
        for row in (aux_row, final_row)
    ]


def raw_put_seconds(
    backend: obstore.store.S3Store, objects: list[np.ndarray], threads: int, prefix: str
) -> float:
    def put(item: tuple[int, np.ndarray]) -> None:
        obstore.put(backend, f"{prefix}/{item[0]}", item[1], use_multipart=False)

    with ThreadPoolExecutor(threads) as pool:
        start = time.perf_counter()
        list(pool.map(put, enumerate(objects)))
        return time.perf_counter() - start


def delete_prefix(backend: obstore.store.S3Store, prefix: str) -> None:
    """moto keeps every object in memory: each side's objects go once it is timed."""
    for batch in obstore.list(backend, prefix=prefix, chunk_size=1000):
        obstore.delete(backend, [meta["path"] for meta in batch])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=6)
    parser.add_argument("--num-aux", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--samples-per-shard", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()

    samples = make_samples(args.samples, 256, 2048, args.num_aux, args.hidden)
    nbytes = payload_bytes(samples)
    chunk = default_chunk_tokens(args.num_aux, args.hidden)
    manifest = bench_manifest(samples, DEFAULT_CODEC, chunk, args.samples_per_shard)
    objects = chunk_objects(samples, manifest)
    stored = sum(o.nbytes for o in objects)
    print(
        f"{len(samples)} samples, {nbytes / 1e6:.0f} MB payload, {len(objects)} chunk objects "
        f"({stored / 1e6:.0f} MB), chunk_tokens {chunk}, {args.threads} threads"
    )
    names = (f"run{i}" for i in itertools.count())
    with s3_server() as s3:
        backend = open_location(s3.url(""), s3.options).store  # the store's own client config

        def writer() -> float:
            name = next(names)
            store = new_store(s3, f"{name}.zarr", samples, manifest)
            seconds = writer_seconds(samples, store, args.threads)
            delete_prefix(backend, f"{name}.zarr")
            return nbytes / seconds / 1e9

        def baseline() -> float:
            name = next(names)
            seconds = raw_put_seconds(backend, objects, args.threads, name)
            delete_prefix(backend, name)
            return nbytes / seconds / 1e9

        ratios = alternate(baseline, writer, args.rounds)
    ratios.show("GB/s", baseline="raw PUTs", measured="ShardWriter")
    print(ratios.result_line("s3_writer_vs_raw_put", TARGET))


if __name__ == "__main__":
    main()
