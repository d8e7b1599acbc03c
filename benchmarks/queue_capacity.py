"""How many nodes one ShardQueueActor serves: simulated nodes on the real queue, real protocol.

Each simulated node does what a NodeWorker and its lease keeper do at Kimi-K2.5 rates (acquire,
heartbeats while it "writes" a shard, claim, complete; nothing per chunk), as coroutines in
--clients async Ray actors. Levels of --nodes run --seconds each on a fresh queue fed while it
runs; a level passes when p99 `acquire` and `claim` latencies stay under 100 ms and every shard
is committed exactly once. Value: the largest passing level; also printed: calls per committed
GB, against the per-chunk protocol this replaced.

    make bench BENCH=queue_capacity
    .venv/bin/python -m benchmarks.queue_capacity --nodes 500,1000,2000,4000 --seconds 30

What limits it here (Ray's call path), and the figures: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from collections import Counter, defaultdict
from typing import Any

import numpy as np
import ray

from cluster.shard_queue import ShardQueueActor
from tools.ray_head import private_temp_dir

TARGET = 1000
P99_LIMIT_S = 0.1
TIMED = ("acquire", "claim")


@ray.remote(num_cpus=0)
class Nodes:
    """Many simulated nodes, each a coroutine following the worker's protocol."""

    async def run(self, queue: Any, names: list[str], seconds: float, p: dict) -> dict[str, Any]:
        latencies: dict[str, list[float]] = defaultdict(list)
        calls: Counter[str] = Counter()
        completed: list[tuple[int, str]] = []
        end = time.monotonic() + seconds

        async def call(method: str, *args: Any) -> Any:
            calls[method] += 1
            t = time.perf_counter()
            result = await getattr(queue, method).remote(*args)
            if method in TIMED:
                latencies[method].append(time.perf_counter() - t)
            return result

        async def node(name: str) -> None:
            await asyncio.sleep(random.uniform(0, p["shard_s"]))  # nodes do not start in step
            while time.monotonic() < end:
                lease = await call("acquire", name)
                if lease is None:
                    await call("finished")
                    await asyncio.sleep(p["idle_s"])
                    continue
                await call("heartbeat", lease.lease_id)  # the keeper's renewal on start
                done_at = time.monotonic() + p["shard_s"]
                while (left := done_at - time.monotonic()) > 0:
                    await asyncio.sleep(min(p["heartbeat_s"], left))
                    if left > p["heartbeat_s"]:
                        await call("heartbeat", lease.lease_id)
                while (claim := await call("claim", lease.lease_id)) and claim.wait > 0:
                    await asyncio.sleep(min(claim.wait, 1.0))
                if claim and await call("complete", lease.lease_id, {"by": name}):
                    completed.append((lease.shard, name))

        await asyncio.gather(*(node(n) for n in names))
        return {"latencies": dict(latencies), "calls": dict(calls), "completed": completed}


def level(clients: list[Any], nodes: int, args: argparse.Namespace) -> dict[str, Any]:
    shard_s = args.shard_tokens * args.row_bytes / args.rate
    p = {"shard_s": shard_s, "heartbeat_s": args.heartbeat, "idle_s": args.idle}
    # Enough shards that no node idles: about 1 + seconds / shard_s each, plus some spare.
    need = int(nodes * (args.seconds / shard_s + 2))
    queue = ShardQueueActor.remote(
        lease_seconds=args.lease, margin_seconds=args.margin, more_coming=True
    )
    half = need // 2  # the rest arrives while the nodes work, as a streamed plan's shards do
    ray.get(queue.add.remote(list(range(half))))
    names = [f"n{i}" for i in range(nodes)]
    runs = [
        c.run.remote(queue, names[i :: len(clients)], args.seconds, p)
        for i, c in enumerate(clients)
    ]
    time.sleep(min(args.seconds / 2, shard_s))
    ray.get(queue.add.remote(list(range(half, need))))
    results = ray.get(runs)
    ray.get(queue.close.remote())
    status = ray.get(queue.status.remote())
    ray.kill(queue)

    calls = sum((Counter(r["calls"]) for r in results), Counter())
    lat = {m: np.concatenate([r["latencies"].get(m, []) for r in results]) for m in TIMED}
    by_shard: dict[int, list[str]] = defaultdict(list)
    for r in results:
        for shard, name in r["completed"]:
            by_shard[shard].append(name)
    duplicated = sorted(s for s, who in by_shard.items() if len(who) > 1)
    lost = sorted(
        s for s, who in by_shard.items() if status.summaries.get(s, {}).get("by") != who[0]
    )
    unknown = sorted(set(status.summaries) - set(by_shard))  # committed by nobody we saw
    gb = len(by_shard) * args.shard_tokens * args.row_bytes / 1e9
    p99 = {m: float(np.percentile(v, 99)) if len(v) else float("inf") for m, v in lat.items()}
    ok = (
        all(v < P99_LIMIT_S for v in p99.values())
        and not (duplicated or lost or unknown)
        and len(by_shard) > 0
    )
    return {
        "nodes": nodes,
        "ok": ok,
        "p99": p99,
        "p50": {m: float(np.percentile(v, 50)) if len(v) else 0.0 for m, v in lat.items()},
        "calls": calls,
        "calls_per_s": sum(calls.values()) / args.seconds,
        "shards": len(by_shard),
        "gb": gb,
        "calls_per_gb": sum(calls.values()) / gb if gb else float("inf"),
        "bad": {"duplicated": duplicated, "lost": lost, "unknown": unknown},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", default="250,500,1000,2000,4000", help="levels, in order")
    parser.add_argument("--seconds", type=float, default=30.0, help="per level")
    parser.add_argument("--clients", type=int, default=2, help="async actors simulating nodes")
    parser.add_argument("--rate", type=float, default=1e9, help="bytes/s written per node")
    parser.add_argument("--row-bytes", type=int, default=57344, help="Kimi-K2.5 bytes per token")
    parser.add_argument("--shard-tokens", type=int, default=64 * 4096, help="tokens per shard")
    parser.add_argument("--chunk-bytes", type=float, default=32e6, help="for the old protocol")
    parser.add_argument("--heartbeat", type=float, default=10.0, help="seconds")
    parser.add_argument("--idle", type=float, default=1.0, help="idle poll, seconds")
    parser.add_argument("--lease", type=float, default=300.0)
    parser.add_argument("--margin", type=float, default=210.0)
    args = parser.parse_args()
    shard_gb = args.shard_tokens * args.row_bytes / 1e9
    old = 5 + 2 * shard_gb * 1e9 / args.chunk_bytes + shard_gb / args.rate * 1e9 / args.heartbeat
    print(
        f"shard {shard_gb:.1f} GB, {shard_gb * 1e9 / args.rate:.1f} s per node at "
        f"{args.rate / 1e9:g} GB/s; per-chunk protocol: ~{old / shard_gb:.0f} calls per GB"
    )

    best = 0
    with private_temp_dir() as temp_dir:  # a Ray of its own: own ports, own files
        ray.init(
            address="local",
            num_cpus=2,
            include_dashboard=False,
            log_to_driver=False,
            _temp_dir=temp_dir,
        )
        try:
            clients = [Nodes.remote() for _ in range(args.clients)]
            for nodes in (int(n) for n in args.nodes.split(",")):
                r = level(clients, nodes, args)
                print(
                    f"{nodes:5d} nodes: {r['calls_per_s']:6.0f} calls/s, {r['shards']} shards "
                    f"({r['gb']:.0f} GB), {r['calls_per_gb']:.2f} calls/GB | p50/p99 ms "
                    + ", ".join(
                        f"{m} {r['p50'][m] * 1e3:.1f}/{r['p99'][m] * 1e3:.1f}" for m in TIMED
                    )
                    + f" | {'ok' if r['ok'] else 'FAIL'}"
                    + ("" if not any(r["bad"].values()) else f" {r['bad']}"),
                    flush=True,
                )
                if not r["ok"]:
                    break
                best = nodes
        finally:
            ray.shutdown()
    print(f"RESULT name=queue_capacity value={best} target={TARGET} unit=nodes")


if __name__ == "__main__":
    main()
