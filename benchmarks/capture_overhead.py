"""Prefill throughput of the patched server with capture on vs off, same flags, same prompts.

One server (SGLang's aux capture flags, our plugin dumping to /dev/shm), so flags, weights and
process are identical: "capture on" rounds send rids with the capture prefix, "capture off"
rounds send rids without it, which the plugin skips. A captured request counts as done only
once its dump is published. Rounds alternate (benchmarks/rounds.py); the value is the median of
the per-round ratios. Model: the llama-bench preset (hidden 512, 8 layers).

    make bench BENCH=capture_overhead
"""

from __future__ import annotations

import argparse
import itertools
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from actors.capture_client import generate_and_capture, wait_for_dump
from actors.sglang_server import ServerSpec, SGLangServer
from benchmarks.rounds import alternate
from patches.dump_files import release_dump
from patches.settings import CaptureSettings
from tools.tiny_models import ensure_models

TARGET = 0.95
RID_PREFIX = "hsx-bench-"


def make_prompts(count: int, length: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(10, vocab, (length,), generator=g).tolist() for _ in range(count)]


def prefill_tokens_per_s(
    server: SGLangServer, prompts: list[list[int]], inflight: int, rid_prefix: str
) -> float:
    """Prefill every prompt (K in flight); with capture, a request is done once its dump is."""
    capture = rid_prefix == RID_PREFIX

    def send(i: int) -> None:
        rid = f"{rid_prefix}{i}"
        if capture:  # done once the dump is published; then released, as a worker would
            release_dump(
                wait_for_dump(generate_and_capture(server, rid, input_ids=prompts[i]).dump_path)
            )
        else:
            payload = {
                "rid": rid,
                "input_ids": prompts[i],
                "sampling_params": {"max_new_tokens": 1},
            }
            response = server.session.post(server.url + "/generate", json=payload, timeout=600)
            response.raise_for_status()

    start = time.perf_counter()
    with ThreadPoolExecutor(inflight) as pool:
        list(pool.map(send, range(len(prompts))))
    return sum(map(len, prompts)) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--inflight", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--models", type=Path, default=Path(".cache/models"))
    args = parser.parse_args()

    model = ensure_models(args.models, ["llama-bench"])["llama-bench"]
    prompts = make_prompts(args.prompts, args.length, vocab=1024)
    work = Path(tempfile.mkdtemp(prefix="capture_overhead-", dir="/dev/shm"))
    capture = CaptureSettings.from_env(
        {"HIDDEN_CAPTURE_DIR": str(work / "dumps"), "HIDDEN_CAPTURE_RID_PREFIX": RID_PREFIX}
    )
    off_rounds = itertools.count()  # fresh rids each round: nothing served from a cache
    try:
        with SGLangServer(
            ServerSpec(model_path=model, capture=capture), work / "server.log"
        ) as server:
            for prefix in (RID_PREFIX, "warmup-"):
                prefill_tokens_per_s(server, prompts[: args.inflight], args.inflight, prefix)
            rounds = alternate(
                baseline=lambda: prefill_tokens_per_s(
                    server, prompts, args.inflight, f"off{next(off_rounds)}-"
                ),
                measured=lambda: prefill_tokens_per_s(server, prompts, args.inflight, RID_PREFIX),
                rounds=args.rounds,
            )
    finally:
        shutil.rmtree(work, ignore_errors=True)

    print(f"{args.prompts} prompts x {args.length} tokens, {args.inflight} in flight")
    rounds.show("tokens/s", baseline="capture off", measured="capture on")
    print(rounds.result_line("capture_overhead", TARGET))


if __name__ == "__main__":
    main()
