"""A follow reader over a finished store vs the plain reader, same store, same disk.

Both are HiddenStatesIterable, built once each (as a training loop builds one), one epoch per
round: `follow=True` also reads the job's report at the start and checks the store is complete
at the end (the polls a finished store needs). Warm files; GB/s of hidden-state payload; rounds
alternate (benchmarks/rounds.py), value = median of per-round ratios. The store is written first
by the real ShardWriter, Kimi-shaped bf16 rows.

    make bench BENCH=follow_vs_plain_read
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

from benchmarks.reader_vs_raw_read import build_store, reader_seconds
from benchmarks.rounds import alternate
from hsx_store.reader import HiddenStatesIterable

TARGET = 0.95


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=24)
    parser.add_argument("--num-aux", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--rounds", type=int, default=11)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=os.getcwd(), prefix=".bench-follow-") as tmp:
        url, payload = build_store(Path(tmp), args.samples, args.num_aux, args.hidden)
        print(f"store: {args.samples} samples, {payload / 1e9:.2f} GB of hidden states")
        plain = HiddenStatesIterable(url)
        follow = HiddenStatesIterable(url, follow=True)
        reader_seconds(plain)  # warm the page cache (and both sides' memory)
        reader_seconds(follow)
        assert follow.ended == "the job is complete: every planned shard is committed"
        rounds = alternate(
            baseline=lambda: payload / reader_seconds(plain) / 1e9,
            measured=lambda: payload / reader_seconds(follow) / 1e9,
            rounds=args.rounds,
        )
    rounds.show("GB/s", baseline="plain reader", measured="follow reader")
    print(rounds.result_line("follow_vs_plain_read", TARGET))


if __name__ == "__main__":
    main()
