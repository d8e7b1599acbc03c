"""Follow lag: from a shard's commit to a follow reader yielding its first sample, on a store
that is being written, on local disk and on the S3 server on loopback (moto).

A thread commits shards one after the other with the real ShardWriter (small rows: the lag is
measured, not the bandwidth), pausing a random 0 to `max_poll_s` between commits, so the reader
is caught at every point of its backoff; a follow reader (`poll_s`, `max_poll_s` as given) yields
them in the main thread. The lag of a shard: the reader's first sample of it minus the moment
its commit returned. Per round (one store, `--shards` commits) the value is 2 x poll_s / the
median lag (>= 1: the median lag is within two poll intervals, the target); the result is the
median over rounds, local and S3 alternating, the worse of the two. Medians and p99 printed.

    make bench BENCH=follow_lag
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from actors.shard_writer import ShardWriter
from benchmarks.reader_vs_raw_read import stand_in_manifest
from hsx_store.builder import create_store
from hsx_store.reader import HiddenStatesIterable
from tools.s3_server import s3_server

TARGET = 1.0
NUM_AUX, HIDDEN, PER_SHARD, LENGTH = 3, 64, 4, 32


def one_round(
    root: Path,
    url: str,
    options: dict[str, Any] | None,
    shards: int,
    poll_s: float,
    max_poll_s: float,
) -> list[float]:
    """Lags (s) of `shards` commits followed by one reader."""
    manifest = stand_in_manifest(
        root, NUM_AUX, HIDDEN, max_length=LENGTH, samples_per_shard=PER_SHARD
    )
    n = shards * PER_SHARD
    ids = [np.arange(1, LENGTH + 1, dtype=np.int32)] * n
    masks = [np.ones(LENGTH, np.uint8)] * n
    store = create_store(
        url, manifest, [f"s{i}" for i in range(n)], ids, masks, storage_options=options
    )
    aux = torch.ones((LENGTH, NUM_AUX, HIDDEN), dtype=torch.bfloat16)  # as a server dumps
    final = torch.ones((LENGTH, HIDDEN), dtype=torch.bfloat16)
    committed_at: dict[int, float] = {}
    failed: list[BaseException] = []

    def write() -> None:
        try:
            for sh in store.shards:
                time.sleep(random.uniform(0, max_poll_s))
                writer = ShardWriter(store, sh)
                for i in range(sh.sample_begin, sh.sample_end):
                    writer.write_sample(i, aux, final)
                writer.commit({})
                committed_at[sh.index] = time.monotonic()
        except BaseException as exc:
            failed.append(exc)
            raise

    reader = HiddenStatesIterable(
        url,
        storage_options=options,
        follow=True,
        poll_s=poll_s,
        max_poll_s=max_poll_s,
        idle_timeout_s=30,  # a writer that failed: end, and say so below
    )
    writing = threading.Thread(target=write)
    writing.start()
    first_seen: dict[int, float] = {}
    for sample in reader:
        shard = int(sample["sample_id"][1:]) // PER_SHARD
        first_seen.setdefault(shard, time.monotonic())
    writing.join()
    if failed:
        raise failed[0]
    assert reader.ended and "complete" in reader.ended, reader.ended
    assert sorted(first_seen) == list(range(shards)), "every shard was followed"
    return [first_seen[k] - committed_at[k] for k in range(shards)]


def p99(values: list[float]) -> float:
    return float(np.percentile(values, 99))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=int, default=12)
    parser.add_argument("--poll-s", type=float, default=0.2)
    parser.add_argument("--max-poll-s", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    random.seed(0)
    values: dict[str, list[float]] = {"local": [], "s3": []}
    lags: dict[str, list[float]] = {"local": [], "s3": []}
    with tempfile.TemporaryDirectory(prefix="bench-follow-") as tmp, s3_server() as s3:
        for r in range(args.rounds):
            for where in ("local", "s3") if r % 2 == 0 else ("s3", "local"):
                root = Path(tmp) / f"{where}-{r}"
                root.mkdir()
                url = str(root / "s.zarr") if where == "local" else s3.url(f"follow-{r}.zarr")
                options = None if where == "local" else s3.options
                round_lags = one_round(
                    root, url, options, args.shards, args.poll_s, args.max_poll_s
                )
                lags[where] += round_lags
                values[where].append(2 * args.poll_s / statistics.median(round_lags))
    for where in ("local", "s3"):
        rounds = " ".join(f"{v:.2f}" for v in values[where])
        print(
            f"  {where:5s} lag median {statistics.median(lags[where]) * 1e3:6.0f} ms, "
            f"p99 {p99(lags[where]) * 1e3:6.0f} ms over {len(lags[where])} commits "
            f"(poll {args.poll_s * 1e3:.0f} ms, backing off to {args.max_poll_s * 1e3:.0f} ms); "
            f"2 x poll / median per round: {rounds}"
        )
    worse = min(statistics.median(v) for v in values.values())
    spread = [f"{min(v):.2f}..{max(v):.2f}" for v in values.values()]
    print(f"  spread local {spread[0]}, s3 {spread[1]} over {args.rounds} rounds")
    print(f"RESULT name=follow_lag value={worse:.3f} target={TARGET} unit=ratio")


if __name__ == "__main__":
    main()
