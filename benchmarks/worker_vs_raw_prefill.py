"""Node-worker extraction tokens/s vs the raw prefill tokens/s of the same patched server.

Raw: a plain concurrent client (K in flight) prefills the prompts on a patched server started
with the worker's own flags, using rids the plugin does not capture. Worker: a NodeWorker on a
local Ray leases the shards of a store planned from the same prompts and runs them end to end
(its own server, calibration, K in flight, dumps on /dev/shm read and verified, store writes,
commits); its tokens/s counts from its first lease to its last commit, with the store on the
repo's disk (.cache/). Each side starts its own server every round (an idle server still takes
CPU on 2 cores, so none is left running); rounds alternate (benchmarks/rounds.py) and the value
is the median of the per-round ratios.

    make bench BENCH=worker_vs_raw_prefill
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import ray
import torch

from actors.config import WorkerJobConfig
from actors.node_plan import NodePlan
from actors.node_worker import NodeWorker
from actors.sglang_server import ServerSpec, SGLangServer
from benchmarks.rounds import alternate
from cluster.shard_queue import ShardQueueActor
from hsx_store.builder import create_store
from hsx_store.format import make_manifest
from hsx_store.layers import expected_capture
from patches.settings import CaptureSettings
from tools.ray_head import local_ray
from tools.tiny_models import ensure_models

TARGET = 0.85


def raw_prefill_tokens_per_s(
    model: Path, prompts: list[list[int]], inflight: int, work: Path, tag: str
) -> float:
    # The worker's server flags: its config's defaults on a CPU node.
    capture = CaptureSettings(work / "raw-dumps", "hsx-", 1 << 30, mla_cpu_fix=True)
    spec = ServerSpec(
        model_path=model,
        capture=capture,
        max_total_tokens=8192,
        extra_args=["--dtype", "bfloat16"],
        device="cpu",  # as the worker's (a CPU plan), on a GPU machine too
    )

    def send(i: int) -> None:
        payload = {"rid": f"raw-{tag}-{i}", "input_ids": prompts[i]}
        payload["sampling_params"] = {"max_new_tokens": 1}
        server.session.post(server.url + "/generate", json=payload, timeout=600).raise_for_status()

    with (
        SGLangServer(spec, work / f"raw-{tag}.log") as server,
        ThreadPoolExecutor(inflight) as pool,
    ):
        list(pool.map(send, range(inflight)))  # warm up
        start = time.perf_counter()
        list(pool.map(send, range(len(prompts))))
        seconds = time.perf_counter() - start
    return sum(map(len, prompts)) / seconds


def worker_tokens_per_s(
    model: Path, prompts: list[list[int]], args: argparse.Namespace, work: Path, tag: str
) -> float:
    url = Path(tempfile.mkdtemp(prefix="worker_vs_raw-store-", dir=".cache")) / "store.zarr"
    manifest = make_manifest(
        str(model),
        model,
        expected_capture(model, None, "bfloat16"),
        max_length=4096,
        samples_per_shard=args.per_shard,
    )
    ids = [np.asarray(p, np.int32) for p in prompts]
    masks = [np.ones(len(p), np.uint8) for p in prompts]
    store = create_store(url, manifest, [f"s{i}" for i in range(len(ids))], ids, masks)
    queue = ShardQueueActor.remote(range(len(store.shards)), lease_seconds=120)
    config = WorkerJobConfig.model_validate(
        {
            "model": {"path": str(model)},
            "store": {"url": str(url)},
            "worker": {"inflight": args.inflight, "dump_root": str(work)},
        }
    )
    worker = NodeWorker.options(resources={"sglang_node": 1}).remote(
        config, queue, plan=NodePlan.on_cpu(1, None)
    )
    try:
        summaries = ray.get(worker.run.remote())
    finally:
        shutil.rmtree(url.parent, ignore_errors=True)
    if any(s.get("failed") or s.get("lease_lost") for s in summaries):
        raise RuntimeError(f"the worker did not write every sample: {summaries}")
    # Its own clock: from the first lease to the last commit (server start-up excluded).
    seconds = sum(s["seconds"] for s in summaries)
    return sum(s["tokens"] for s in summaries) / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=48)
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--inflight", type=int, default=8)
    parser.add_argument("--per-shard", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--models", type=Path, default=Path(".cache/models"))
    args = parser.parse_args()

    model = ensure_models(args.models, ["llama-bench"])["llama-bench"]
    g = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(10, 1024, (args.length,), generator=g).tolist() for _ in range(args.prompts)
    ]
    work = Path(tempfile.mkdtemp(prefix="worker_vs_raw-", dir="/dev/shm"))
    tags = iter(range(2 * args.rounds))
    try:
        with local_ray(2, resources={"sglang_node": 1}):  # own ports, own files
            rounds = alternate(
                baseline=lambda: raw_prefill_tokens_per_s(
                    model, prompts, args.inflight, work, f"r{next(tags)}"
                ),
                measured=lambda: worker_tokens_per_s(model, prompts, args, work, f"r{next(tags)}"),
                rounds=args.rounds,
            )
    finally:
        shutil.rmtree(work, ignore_errors=True)

    print(f"{args.prompts} prompts x {args.length} tokens, K={args.inflight} in flight")
    rounds.show("tokens/s", baseline="raw prefill", measured="worker")
    print(rounds.result_line("worker_vs_raw_prefill", TARGET))


if __name__ == "__main__":
    main()
