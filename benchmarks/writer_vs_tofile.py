"""ShardWriter into a Zarr store vs plain file writes of the same chunk files, on the same disk.

Baseline: one plain file per chunk the store holds, the same bytes (rows in place, zeros for
padding) at the same path shape, written by as many threads as the writer uses. Measured: the
ShardWriter writing the same bf16 rows shard by shard into a fresh store, commits included.
Rates over the payload bytes; neither side fsyncs; each starts with no dirty pages and its
memory faulted in (benchmarks/rounds.py); rounds alternate, value = median of per-round ratios.
Synthetic rows that compress like real bf16 activations. `--sweep` prints the codec x chunk x
threads table that chose the defaults in hsx_store/format.py.

    .venv/bin/python -m benchmarks.writer_vs_tofile         # or: make bench BENCH=writer_vs_tofile
    .venv/bin/python -m benchmarks.writer_vs_tofile --sweep --shm

Why this baseline, what the ratio depended on, figures: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch

from actors.shard_writer import ShardWriter
from benchmarks.rounds import Rounds, alternate
from hsx_store.builder import create_store
from hsx_store.format import (
    DEFAULT_CODEC,
    SCHEMA_VERSION,
    Manifest,
    Store,
    default_chunk_tokens,
    layout,
)

TARGET = 0.8
Samples = list[tuple[torch.Tensor, ...]]  # (aux, post-norm[, pre-norm]) per sample
Config = tuple[dict[str, Any], int, int]  # codec, chunk_tokens, threads


def make_samples(count: int, lo: int, hi: int, num_aux: int, hidden: int) -> Samples:
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(lo, hi + 1, (count,), generator=g).tolist()
    scale = torch.exp(torch.randn(num_aux + 1, hidden, generator=g) * 1.5)  # per channel

    def rows(p: int) -> torch.Tensor:
        return (torch.randn(p, num_aux + 1, hidden, generator=g) * scale).to(torch.bfloat16)

    return [(x[:, :num_aux].contiguous(), x[:, num_aux].contiguous()) for x in map(rows, lengths)]


def payload_bytes(samples: Samples) -> int:
    return sum(a.nbytes + f.nbytes for a, f in samples)


def _bytes(x: torch.Tensor) -> memoryview:
    return memoryview(x.view(torch.int16).numpy()).cast("B")


def chunk_files_seconds(
    samples: Samples, root: Path, chunk: int, per_shard: int, threads: int
) -> float:
    """The baseline: the store's chunk files (same sizes, same bytes), written plainly by
    `threads` threads (the writer's count), in store order."""
    starts, _, total = layout([len(a) for a, _ in samples], per_shard, chunk)
    # Zeros never written (calloc'd pages read back as the shared zero page), as the writer's.
    row_bytes = _row_bytes(samples)
    zero = {n: memoryview(np.zeros(chunk * row, np.uint8)) for n, row in row_bytes.items()}

    def write(k: int) -> None:
        for n, index in (("aux", 0), ("final", 1)):
            row = row_bytes[n]
            folder = root / "chunks" / n / "c" / str(k) / "0"  # the store's key: c/k/0[/0]
            folder.mkdir(parents=True)
            with (folder / "0").open("wb") as f:
                at = k * chunk
                for i in _samples_in(starts, samples, at, at + chunk):
                    lo, hi = max(at, starts[i]), min(at + chunk, starts[i] + len(samples[i][0]))
                    if lo > at:
                        f.write(zero[n][: (lo - at) * row])
                    f.write(_bytes(samples[i][index][lo - starts[i] : hi - starts[i]]))
                    at = hi
                if at < (k + 1) * chunk:
                    f.write(zero[n][: ((k + 1) * chunk - at) * row])

    with ThreadPoolExecutor(threads) as pool:
        start = time.perf_counter()
        list(pool.map(write, range(total // chunk)))
        seconds = time.perf_counter() - start
    shutil.rmtree(root / "chunks")
    return seconds


def _row_bytes(samples: Samples) -> dict[str, int]:
    aux, final = samples[0]
    return {"aux": aux[0].nbytes, "final": final[0].nbytes}


def _samples_in(starts: np.ndarray, samples: Samples, lo: int, hi: int) -> range:
    """The samples with rows in [lo, hi), in order."""
    ends = starts + np.array([len(a) for a, _ in samples])
    return range(int(np.searchsorted(ends, lo, "right")), int(np.searchsorted(starts, hi)))


def bench_manifest(
    samples: Samples, codec: dict[str, Any], chunk: int, per_shard: int, dtype: str = "bfloat16"
) -> Manifest:
    """The manifest of a store for these synthetic rows (no model behind it): (aux, post-norm)
    per sample, or (aux, post-norm, pre-norm)."""
    aux0 = samples[0][0]
    return Manifest(
        schema_version=SCHEMA_VERSION,
        model="bench",
        model_config_hash="",
        tokenizer_hash="",
        weights_fingerprint="",
        chat_template_hash=None,
        layer_ids=list(range(aux0.shape[1])),
        layer_convention="bench",
        final_states=["post_norm", "pre_norm"][: len(samples[0]) - 1],
        hidden_size=aux0.shape[2],
        num_aux=aux0.shape[1],
        dtype=dtype,
        max_length=max(a.shape[0] for a, *_ in samples),
        codec=codec,
        chunk_tokens=chunk,
        samples_per_shard=per_shard,
    )


def new_store(
    samples: Samples,
    root: Path,
    codec: dict[str, Any],
    chunk: int,
    per_shard: int,
    dtype: str = "bfloat16",
) -> Store:
    manifest = bench_manifest(samples, codec, chunk, per_shard, dtype)
    path = root / "store.zarr"
    ids = [np.zeros(a.shape[0], np.int32) for a, *_ in samples]
    masks = [np.ones(a.shape[0], np.uint8) for a, *_ in samples]
    create_store(path, manifest, [str(i) for i in range(len(samples))], ids, masks)
    return Store.open(path, mode="r+")


def writer_seconds(samples: Samples, store: Store, threads: int) -> float:
    """Seconds to write and commit every shard."""
    start = time.perf_counter()
    for shard in store.shards:
        writer = ShardWriter(store, shard, threads=threads)
        for i in range(shard.sample_begin, shard.sample_end):
            writer.write_sample(i, *samples[i])
        writer.commit({})
    return time.perf_counter() - start


def stored_bytes(path: Path) -> int:
    return sum(
        p.stat().st_size
        for name in ("aux_hidden_states", "final_hidden_states")
        for p in (path / name).rglob("*")
        if p.is_file() and p.name != "zarr.json"
    )


def measure(
    samples: Samples, root: Path, config: Config, per_shard: int, rounds: int, repeats: int
) -> tuple[Rounds, float]:
    """Alternating rounds of baseline and writer, each side writing everything `repeats` times
    a round (a longer window evens out the neighbours' bursts); also the compression ratio."""
    codec, chunk, threads = config
    nbytes, stored = payload_bytes(samples), [0]

    def writer() -> float:
        seconds = 0.0
        for _ in range(repeats):
            store = new_store(samples, root, codec, chunk, per_shard)  # untimed: the driver's
            seconds += writer_seconds(samples, store, threads)
            stored[0] = stored_bytes(root / "store.zarr")
            shutil.rmtree(root / "store.zarr")
        return repeats * nbytes / seconds / 1e9

    def baseline() -> float:
        seconds = sum(
            chunk_files_seconds(samples, root, chunk, per_shard, threads) for _ in range(repeats)
        )
        return repeats * nbytes / seconds / 1e9

    # Every call starts with no dirty pages: else the kernel's writeback throttling lands on
    # whichever side crosses the dirty limit, and rounds flip between ~4 and ~0.5 GB/s. And
    # with memory the host backs: twice the payload covers the chunk files' page cache.
    ratios = alternate(baseline, writer, rounds, between=os.sync, fault_in_bytes=2 * nbytes)
    return ratios, nbytes / stored[0]


def sweep_configs(default: Config, sweep: bool) -> list[Config]:
    if not sweep:
        return [default]
    return [default] + [
        (codec, chunk, threads)
        for codec in ({"name": "none"}, {"name": "zstd", "level": 1})
        for chunk in (256, 1024, 4096, 8192)
        for threads in (1, 2, 4)
        if (codec, chunk, threads) != default
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--min-len", type=int, default=256)
    parser.add_argument("--max-len", type=int, default=2048)
    parser.add_argument("--num-aux", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=1024)
    # The job's default shard size (cluster/config.py): per-shard costs amortize as in a job.
    parser.add_argument("--samples-per-shard", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--chunk-tokens", type=int, help="default: the store's default")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--repeats", type=int, default=3, help="writes per side per round")
    parser.add_argument("--sweep", action="store_true", help="codec x chunk_tokens x threads")
    parser.add_argument("--shm", action="store_true", help="also measure on /dev/shm")
    parser.add_argument("--also", type=Path, action="append", default=[], help="another dir")
    args = parser.parse_args()

    samples = make_samples(args.samples, args.min_len, args.max_len, args.num_aux, args.hidden)
    nbytes = payload_bytes(samples)
    print(f"{len(samples)} samples, {nbytes / 1e6:.0f} MB of bf16 rows, H={args.hidden}")
    chunk = args.chunk_tokens or default_chunk_tokens(args.num_aux, args.hidden)
    configs = sweep_configs((DEFAULT_CODEC, chunk, args.threads), args.sweep)
    result: Rounds | None = None  # the first directory's default configuration
    for where in [Path.cwd(), *args.also] + ([Path("/dev/shm")] if args.shm else []):
        with tempfile.TemporaryDirectory(dir=where, prefix=".bench-writer-") as tmp:
            table = []
            for config in configs:
                ratios, compression = measure(
                    samples, Path(tmp), config, args.samples_per_shard, args.rounds, args.repeats
                )
                result = result or ratios
                table.append((config, ratios, compression))
                if config == configs[0]:
                    print(f"\n[{where}] default config, payload GB/s per round:")
                    ratios.show("GB/s", baseline="chunk files", measured="ShardWriter")
        if args.sweep:
            print(f"\n[{where}]\n| codec | chunk_tokens | threads | GB/s | vs baseline | compr |")
            print("|---|---|---|---|---|---|")
            for (codec, chunk, threads), ratios, compression in table:
                name = "-".join(str(v) for v in codec.values())
                gbps = sorted(ratios.measured)[len(ratios.measured) // 2]
                print(
                    f"| {name} | {chunk} | {threads} | {gbps:.2f} | "
                    f"{ratios.median:.2f} | {compression:.2f} |"
                )
    assert result is not None
    print(result.result_line("writer_vs_tofile", TARGET))


if __name__ == "__main__":
    main()
