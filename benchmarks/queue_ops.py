"""Lease round trips per second through the real ShardQueueActor, vs Ray's own call overhead.

A round trip is what a worker does per shard at the least: `acquire` -> `begin_write` ->
`end_write` -> `claim` -> `complete`, each a blocking `ray.get` of one actor call (as
actors/lease_keeper.py does through `ray_caller`). --clients client actors (num_cpus=0, one
process each, as N workers would be) run their share of --shards round trips concurrently, each
one after the other; the rate is all round trips over the span from the first client's start to
the last one's end (after a short warm-up per client, not timed).

Baseline, same run: the same clients make the same five calls per round trip (same arguments) to
a no-op method of a trivial num_cpus=0 actor, so value / baseline is the queue's own cost over
Ray's call overhead. Also printed: the plain ShardQueue in-process (no Ray), the cost of the
queue's Python alone: its first 1000 round trips, and 1000 more after --scale leases.

What limits it (2-core VM shared with other test runs, Ray 2.60): Ray's call path, not the
queue. The queue's calls cost about what the no-op's do (queue / baseline 0.81-1.00 over four
runs, with the load; 250-350 round trips/s, i.e. 1300-1750 blocking calls/s). No actor variant
lifts the machine's call ceiling: a no-op async actor did 800-1500 calls/s, max_concurrency=8
900-1800, 1-8 clients 1300-2050, driver threads instead of client actors 1200-1500, and even
calls fired without waiting from one client only 2600 calls/s; 2000 round trips/s needs 10000.
A py-spy of the queue actor: ~90% in Ray's core worker (main_loop, (de)serialization,
signal/proctitle bookkeeping), ~8% in ShardQueue. The queue's own cost once grew with the
leases issued (`end_write` left a zero count per lease that `acquire`/`fenced` walked: ~60000
round trips/s in-process at first, ~430 after 30000 leases); `end_write` now drops the key at
zero and the in-process figure stays flat (printed below, before and after --scale leases).
Batching the five calls into one actor call (not what a worker can do: the writes happen
between them) reached ~1160 round trips/s here.

    make bench BENCH=queue_ops
    .venv/bin/python -m benchmarks.queue_ops --clients 4 --shards 6000
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np
import ray

from actors.lease_keeper import ray_caller
from cluster.shard_queue import ShardQueue, ShardQueueActor
from tools.ray_head import private_temp_dir

TARGET = 2000
METHODS = ("acquire", "begin_write", "end_write", "claim", "complete")


@ray.remote(num_cpus=0)
class Noop:
    """The baseline: a method that does nothing, on an actor that holds nothing."""

    def call(self, *args: Any) -> None:
        return None


@ray.remote(num_cpus=0)
class Client:
    """One worker's side: lease round trips, one after the other, timing every call."""

    def __init__(self, name: str) -> None:
        self.name = name

    def ready(self) -> bool:
        return True

    def run(self, target: Any, queue: bool, count: int) -> dict[str, Any]:
        call = ray_caller(target)
        lat = {m: np.empty(count) for m in METHODS}
        done = 0
        start = time.time()
        for i in range(count):
            times = []
            if queue:
                t = time.perf_counter()
                lease = call("acquire", self.name)
                times.append(time.perf_counter() - t)
                if lease is None:
                    break
                lease_id = lease.lease_id
                for method, args in (
                    ("begin_write", (lease_id,)),
                    ("end_write", (lease_id,)),
                    ("claim", (lease_id,)),
                    ("complete", (lease_id, {})),
                ):
                    t = time.perf_counter()
                    ok = call(method, *args)
                    times.append(time.perf_counter() - t)
                    assert ok is not False, f"{method} refused lease {lease_id}"
            else:
                lease_id = f"{i:032x}"
                for args in ((self.name,), (lease_id,), (lease_id,), (lease_id,), (lease_id, {})):
                    t = time.perf_counter()
                    call("call", *args)
                    times.append(time.perf_counter() - t)
            for method, seconds in zip(METHODS, times, strict=True):
                lat[method][i] = seconds
            done += 1
        return {
            "start": start,
            "end": time.time(),
            "done": done,
            "lat": {m: v[:done] for m, v in lat.items()},
        }


def phase(
    clients: list[Any], target: Any, queue: bool, per_client: int, warmup: int
) -> tuple[float, dict[str, np.ndarray]]:
    """Round trips/s over all clients, and every call's latency (s) by method."""
    ray.get([c.run.remote(target, queue, warmup) for c in clients])
    results = ray.get([c.run.remote(target, queue, per_client) for c in clients])
    done = sum(r["done"] for r in results)
    span = max(r["end"] for r in results) - min(r["start"] for r in results)
    lat = {m: np.concatenate([r["lat"][m] for r in results]) for m in METHODS}
    return done / span, lat


def in_process(queue: ShardQueue, count: int) -> float:
    """Round trips/s of a plain ShardQueue in this process: the queue's Python cost alone."""
    start = time.perf_counter()
    for _ in range(count):
        lease = queue.acquire("w")
        assert lease is not None
        queue.begin_write(lease.lease_id)
        queue.end_write(lease.lease_id)
        queue.claim(lease.lease_id)
        queue.complete(lease.lease_id, {})
    return count / (time.perf_counter() - start)


def percentiles(seconds: np.ndarray) -> str:
    p50, p90, p99 = np.percentile(seconds, [50, 90, 99]) * 1e6
    return f"p50 {p50:7.0f}  p90 {p90:7.0f}  p99 {p99:7.0f}  max {seconds.max() * 1e6:7.0f}"


def report(label: str, rate: float, lat: dict[str, np.ndarray]) -> None:
    calls = np.concatenate(list(lat.values()))
    print(f"\n{label}: {rate:.0f} round_trips/s ({5 * rate:.0f} calls/s)")
    print(f"  per-call latency, us   {'all calls':<12} {percentiles(calls)}")
    for method, seconds in lat.items():
        print(f"                         {method:<12} {percentiles(seconds)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=4, help="client actors (workers)")
    parser.add_argument("--shards", type=int, default=4000, help="timed round trips, all clients")
    parser.add_argument("--scale", type=int, default=10000, help="leases, in-process scaling")
    parser.add_argument("--warmup", type=int, default=100, help="untimed round trips per client")
    args = parser.parse_args()
    per_client = args.shards // args.clients
    timed = per_client * args.clients

    # The queue's own cost grows with the leases it has issued (see the module doc): the rate of
    # its first 1000 round trips, then of 1000 more after --scale leases in all.
    plain = ShardQueue(range(args.scale + 1000))
    first = in_process(plain, 1000)
    in_process(plain, args.scale - 1000)
    later = in_process(plain, 1000)
    print(
        f"in-process ShardQueue (no Ray): {first:.0f} round_trips/s over its first 1000 leases, "
        f"{later:.0f} after {args.scale}"
    )

    with private_temp_dir() as temp_dir:  # a Ray of its own: own ports, own files
        ray.init(
            address="local",
            num_cpus=2,
            include_dashboard=False,
            log_to_driver=False,
            _temp_dir=temp_dir,
        )
        try:
            clients = [Client.remote(f"w{i}") for i in range(args.clients)]
            noop = Noop.remote()
            queue = ShardQueueActor.remote(range(args.clients * args.warmup + timed))
            ray.get([c.ready.remote() for c in clients] + [noop.call.remote()])
            print(f"{args.clients} client actors, {timed} timed round trips each phase")
            base, base_lat = phase(clients, noop, False, per_client, args.warmup)
            report("baseline (no-op actor, same 5 calls)", base, base_lat)
            value, lat = phase(clients, queue, True, per_client, args.warmup)
            report("ShardQueueActor", value, lat)
            status = ray.get(queue.status.remote())
            assert status.completed == status.total and status.finished, status
        finally:
            ray.shutdown()
    print(f"\nqueue / baseline: {value / base:.2f}")
    print(f"RESULT name=queue_ops value={value:.0f} target={TARGET} unit=round_trips/s")


if __name__ == "__main__":
    main()
