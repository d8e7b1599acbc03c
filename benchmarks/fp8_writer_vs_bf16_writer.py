"""The shard writer into an FP8 store vs into a bf16 store: the same bf16 rows, the same disk.

Samples are Kimi-shaped (1,024 tokens x 3 aux + post-norm + pre-norm x 7,168), bf16, as a
server that does not quantize dumps them. Baseline: the ShardWriter writing them into a bf16
store (the rows as they are). Measured: the ShardWriter writing the same rows into an
fp8_e4m3 store, quantizing them on its write threads as it writes each chunk (the C kernel,
hsx_kernels/fp8_cpu.c, through hsx_store/fp8.py `quantize_into`). Both write and
commit every shard of a fresh store; rates are GB/s of bf16 input; neither fsyncs; each call
starts with no dirty pages and its memory faulted in (benchmarks/rounds.py); rounds alternate,
value = median of the per-round ratios. Also printed: the FP8 store fed rows the server
quantized (Fp8Rows: stored as they are), the kernel alone in each variant this CPU runs, and the
quantizer alone (`quantize`, into new arrays) per thread count.

    .venv/bin/python -m benchmarks.fp8_writer_vs_bf16_writer   # or: make bench BENCH=...

Figures and what they depend on: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from benchmarks.rounds import alternate
from benchmarks.writer_vs_tofile import new_store, writer_seconds
from hsx_kernels import fp8_cpu
from hsx_store.format import DEFAULT_CODEC, default_chunk_tokens
from hsx_store.fp8 import FP8_DTYPE, Fp8Rows, quantize, quantize_rows

TARGET = 0.95
Sample = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # aux, post-norm, pre-norm


def make_samples(count: int, tokens: int, num_aux: int, hidden: int) -> list[Sample]:
    """Rows with per-channel magnitudes over ~4 decades, as activations have."""
    g = torch.Generator().manual_seed(0)
    scale = torch.exp(torch.randn(num_aux + 2, hidden, generator=g) * 1.5)

    def sample() -> Sample:
        x = (torch.randn(tokens, num_aux + 2, hidden, generator=g) * scale).to(torch.bfloat16)
        return x[:, :num_aux].contiguous(), x[:, num_aux].contiguous(), x[:, -1].contiguous()

    return [sample() for _ in range(count)]


def server_quantized(samples: list[Sample]) -> list[tuple[Fp8Rows, ...]]:
    """The same rows as a quantizing server dumps them."""
    return [tuple(Fp8Rows(*quantize_rows(x)) for x in s) for s in samples]


def writer_rate(root: Path, samples: list, dtype: str, per_shard: int, nbytes: int) -> float:
    """GB/s of bf16 input: every shard of a fresh store written and committed (the store's
    creation untimed, as the driver's)."""
    num_aux, hidden = samples[0][0].shape[1:]
    chunk = default_chunk_tokens(num_aux, hidden)
    store = new_store(samples, root, DEFAULT_CODEC, chunk, per_shard, dtype)
    seconds = writer_seconds(samples, store, threads=2)
    shutil.rmtree(root / "store.zarr")
    return nbytes / seconds / 1e9


def kernel_rates(samples: list[Sample], nbytes: int, rows: int = 32) -> None:
    """The C kernel alone, each variant this CPU runs, on one thread: blocks of `rows` rows
    into a reused buffer, as the writer calls it."""
    blocks = [x.reshape(-1, x.shape[-1]).view(torch.int16).numpy() for s in samples for x in s]
    width = blocks[0].shape[1]
    out, scales = np.empty((rows, width), np.uint8), np.empty(rows, np.float32)
    for variant in fp8_cpu.variants():
        start = time.perf_counter()
        for bits in blocks:
            for lo in range(0, len(bits), rows):
                n = min(rows, len(bits) - lo)
                fallback = np.ones(n, np.uint8)
                kernel = fp8_cpu.quantize_bf16_rows
                kernel(bits[lo : lo + n], out[:n], scales[:n], fallback, variant)
        seconds = time.perf_counter() - start
        print(f"  kernel alone, {variant}, 1 thread: {nbytes / seconds / 1e9:.2f} GB/s")


def quantizer_rates(samples: list[Sample], nbytes: int) -> None:
    for threads in (1, 2):
        with ThreadPoolExecutor(threads) as pool:
            start = time.perf_counter()
            for sample in samples:
                for x in sample:
                    quantize(x, "x", pool)
            seconds = time.perf_counter() - start
        print(f"  quantize alone, {threads} thread(s): {nbytes / seconds / 1e9:.2f} GB/s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--num-aux", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--samples-per-shard", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()

    samples = make_samples(args.samples, args.tokens, args.num_aux, args.hidden)
    prequantized = server_quantized(samples)
    nbytes = sum(x.nbytes for s in samples for x in s)
    threads = torch.get_num_threads()
    print(f"{len(samples)} samples, {nbytes / 1e6:.0f} MB of bf16 rows; torch threads {threads}")
    kernel_rates(samples, nbytes)
    quantizer_rates(samples, nbytes)
    with tempfile.TemporaryDirectory(dir=Path.cwd(), prefix=".bench-fp8-") as tmp:
        root, per_shard = Path(tmp), args.samples_per_shard

        def bf16() -> float:
            return writer_rate(root, samples, "bfloat16", per_shard, nbytes)

        def fp8() -> float:
            return writer_rate(root, samples, FP8_DTYPE, per_shard, nbytes)

        # Every call starts with no dirty pages (writeback throttling must not land on one
        # side) and with the memory it takes faulted in.
        ratios = alternate(bf16, fp8, args.rounds, between=os.sync, fault_in_bytes=2 * nbytes)
        ratios.show("GB/s", baseline="bf16 store", measured="fp8 store, writer quantizes")
        served = [writer_rate(root, prequantized, FP8_DTYPE, per_shard, nbytes) for _ in range(3)]
        rates = " ".join(f"{r:.2f}" for r in served)
        bf16_rate = float(np.median(ratios.baseline))
        print(
            f"  fp8 store, server-quantized rows: {np.median(served):.2f} GB/s ({rates}), "
            f"{np.median(served) / bf16_rate:.2f}x the bf16 store's median"
        )
    print(ratios.result_line("fp8_writer_vs_bf16_writer", TARGET))


if __name__ == "__main__":
    main()
