"""The requests a store's writes make, counted on the loopback S3 server, and what they come to
per node at the Kimi config: where one S3 prefix (3,500 PUT/s) starts to throttle.

Counted through tools/throttling_proxy.py (no rate set: it only counts): the ShardWriter
writing Kimi-shaped rows (3 aux layers x 7168, bf16) shard by shard at several chunk sizes,
checked against what the layout predicts (a PUT per stored array per chunk of each shard's
range, 3 per shard: sample_status, summary, marker); and zarr's sharding codec (inner chunks
in one object) written a chunk at a time, as the writer completes them, and a shard at a time.
The projection to a node applies the same layout to the Kimi job's shape
(ray_configs/kimi_k25_job.yaml: prenorm on, 16 samples a shard, up to 8,192 tokens).

    .venv/bin/python -m benchmarks.s3_request_rate   # ~1 min; the figures in
                                                     # docs/design/object-storage.md

A measurement, not a benchmark: no target and no RESULT line, so `make bench` does not run it
(benchmarks/run.py NOT_BENCHMARKS).
"""

from __future__ import annotations

import argparse
import dataclasses

import numpy as np
import zarr

from actors.shard_writer import ShardWriter
from benchmarks.s3_writer_vs_raw_put import delete_prefix, new_store
from benchmarks.writer_vs_tofile import bench_manifest, make_samples, payload_bytes
from hsx_store.format import DEFAULT_CODEC, Shard, layout
from hsx_store.location import open_location
from tools.s3_server import S3Server, s3_server
from tools.throttling_proxy import ThrottlingProxy

PREFIX_PUTS_PER_S = 3500  # S3's documented PUT rate per prefix
COMMIT_PUTS = 3  # a shard's sample_status chunk, its summary, its commit marker
KIMI_ROW_BYTES = (3 + 1 + 1) * 7168 * 2  # aux x 3, post-norm, pre-norm; bf16
SHARDED_ROWS = 8192
KIMI_ARRAYS, KIMI_PER_SHARD, KIMI_MAX_TOKENS = 3, 16, 8192


def predicted_puts(shards: list[Shard], chunk: int, arrays: int) -> int:
    """A PUT per stored array per chunk of each shard's range (padding chunks too), and the
    shard's commit PUTs."""
    chunks = sum(-(-sh.token_end // chunk) - sh.token_begin // chunk for sh in shards)
    return chunks * arrays + COMMIT_PUTS * len(shards)


def writer_requests(
    s3: S3Server, proxy: ThrottlingProxy, samples: list, chunk: int, per_shard: int
) -> tuple[int, int, int, int]:
    """(PUTs, GETs, PUTs the layout predicts, payload bytes) of writing `samples` into a new
    store on S3 (its creation not counted)."""
    manifest = bench_manifest(samples, DEFAULT_CODEC, chunk, per_shard)
    name = f"writer-{chunk}.zarr"
    store = new_store(dataclasses.replace(s3, endpoint=proxy.endpoint), name, samples, manifest)
    proxy.passed.clear()
    for shard in store.shards:
        writer = ShardWriter(store, shard, threads=2)
        for i in range(shard.sample_begin, shard.sample_end):
            writer.write_sample(i, *samples[i])
        writer.commit({})
    counts = proxy.passed["PUT"], proxy.passed["GET"]
    delete_prefix(open_location(s3.url(""), s3.options).store, name)  # moto keeps all in memory
    return *counts, predicted_puts(store.shards, chunk, arrays=2), payload_bytes(samples)


def sharded_requests(
    s3: S3Server, proxy: ThrottlingProxy, inner: int, per_object: int, write_rows: int
) -> tuple[int, int, int, int]:
    """(PUTs, GETs, bytes PUT, payload bytes) of writing SHARDED_ROWS rows of one aux array in
    objects of `per_object` rows (`inner`-row chunks inside), `write_rows` rows a write."""
    rows, row_shape = SHARDED_ROWS, (3, 7168)
    data = np.ones((write_rows, *row_shape), np.uint16)
    name = f"sharded-{inner}-{per_object}-{write_rows}"
    location = open_location(s3.url(name), {**s3.options, "endpoint": proxy.endpoint})
    array = zarr.create_array(
        location,
        shape=(rows, *row_shape),
        chunks=(inner, *row_shape),
        shards=(per_object, *row_shape) if per_object != inner else None,
        dtype="uint16",
        compressors=None,
    )
    proxy.passed.clear()
    proxy.sent.clear()
    for begin in range(0, rows, write_rows):
        array[begin : begin + write_rows] = data
    counts = proxy.passed["PUT"], proxy.passed["GET"], proxy.sent["PUT"]
    delete_prefix(open_location(s3.url(""), s3.options).store, name)
    return *counts, data.nbytes * (rows // write_rows)


def kimi_puts_per_gb(chunk: int, samples: int = 4096) -> float:
    """PUTs per GB of captured rows at the Kimi job's shape, sample lengths uniform in
    256..8192 tokens."""
    lengths = np.random.default_rng(0).integers(256, KIMI_MAX_TOKENS + 1, samples)
    _, shards, _ = layout(lengths, KIMI_PER_SHARD, chunk)
    return predicted_puts(shards, chunk, KIMI_ARRAYS) / (lengths.sum() * KIMI_ROW_BYTES / 1e9)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=6)
    parser.add_argument("--samples-per-shard", type=int, default=2)
    args = parser.parse_args()
    samples = make_samples(args.samples, 256, 2048, 3, 7168)

    with s3_server() as s3, ThrottlingProxy(s3.endpoint) as proxy:
        measure(s3, proxy, samples, args.samples_per_shard)
    project()


def measure(s3: S3Server, proxy: ThrottlingProxy, samples: list, per_shard: int) -> None:
    print("ShardWriter on S3 (aux + post-norm, 256-2048 tokens a sample), creation excluded:")
    print(f"{'chunk_tokens':>12} {'PUTs':>6} {'predicted':>9} {'GETs':>5} {'PUTs/GB':>8}")
    for chunk in (256, 1024, 4096):
        puts, gets, predicted, nbytes = writer_requests(s3, proxy, samples, chunk, per_shard)
        print(f"{chunk:>12} {puts:>6} {predicted:>9} {gets:>5} {puts / (nbytes / 1e9):>8.1f}")

    print(f"\nzarr sharding codec: {SHARDED_ROWS} rows of one aux array (3 x 7168 bf16):")
    print(f"{'layout':<50} {'PUTs':>5} {'GETs':>5} {'bytes PUT / payload':>20}")
    for inner, per_object, write_rows, what in (
        (1024, 1024, 1024, "chunks of 1024 rows, written a chunk a time"),
        (1024, 4096, 1024, "4 x 1024 rows an object, written a chunk a time"),
        (1024, 4096, 4096, "4 x 1024 rows an object, an object at a time"),
    ):
        puts, gets, sent, nbytes = sharded_requests(s3, proxy, inner, per_object, write_rows)
        print(f"{what:<50} {puts:>5} {gets:>5} {sent / nbytes:>20.2f}")


def project() -> None:
    print(f"\nKimi job shape ({KIMI_ROW_BYTES:,} B a token, 16 samples a shard, 256-8192 tokens):")
    print(f"{'chunk_tokens':>12} {'PUTs/GB':>8} {'PUT/s a node at 1 / 3 GB/s':>28} "
          f"{'nodes to 3,500 PUT/s at 1 / 3 GB/s':>36}")  # fmt: skip
    for chunk in (1024, 2048, 4096, 8192):
        per_gb = kimi_puts_per_gb(chunk)
        rates = f"{per_gb:.0f} / {3 * per_gb:.0f}"
        nodes = f"{PREFIX_PUTS_PER_S / per_gb:.0f} / {PREFIX_PUTS_PER_S / (3 * per_gb):.0f}"
        print(f"{chunk:>12} {per_gb:>8.1f} {rates:>28} {nodes:>36}")


if __name__ == "__main__":
    main()
