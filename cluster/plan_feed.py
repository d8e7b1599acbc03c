"""Planning alongside capture: a driver thread that streams the plan into the store and feeds
each group of planned shards to the queue as it becomes visible, so workers (whose servers
start meanwhile) capture the first shards while the rest is still being planned. A job with
`generate:` plans its samples from the responses as they become durable
(cluster/generation_feed.py)."""

from __future__ import annotations

import threading
import time
from typing import Any

import ray

from cluster.config import JobConfig
from cluster.generation_feed import generate_into
from cluster.generation_stats import GenerationStats
from cluster.job_store import plan_into
from cluster.report import ProgressMeter
from hsx_store.builder import StoreBuilder
from hsx_store.format import Shard
from hsx_store.generated import GeneratedParts


class PlanFeed(threading.Thread):
    def __init__(
        self,
        builder: StoreBuilder,
        config: JobConfig,
        queue: Any,
        meter: ProgressMeter,
        planners: int | None,
        say: Any = print,
        gen_queue: Any = None,
    ) -> None:
        super().__init__(daemon=True, name="plan-feed")
        self.builder, self.config, self.queue, self.meter = builder, config, queue, meter
        self.planners, self.say = planners, say
        self.gen_queue = gen_queue  # a job with `generate:`: its parts of prompts
        self.generation = GenerationStats() if gen_queue is not None else None
        meter.generation = self.generation  # the progress line shows it
        self.error: BaseException | None = None
        self._halt = threading.Event()
        self.started_at = self.finished_at = None  # wall clock (time.time), for the report
        self._began = time.monotonic()
        self.seconds: float | None = None

    def run(self) -> None:
        self.started_at = time.time()
        try:
            if self.generation is not None:
                generate_into(
                    self.builder,
                    self.config,
                    self.gen_queue,
                    GeneratedParts(self.builder.store.group.store),
                    self.planners,
                    self._feed,
                    self.generation,
                    self.say,
                    self._halt,
                )
            else:
                plan_into(
                    self.builder, self.config, self.planners, self._feed, self.say, self._halt
                )
            if not self._halt.is_set():
                ray.get(self.queue.close.remote())  # only now can the job be finished
        except BaseException as exc:  # the driver's watch loop raises it
            self.error = exc
        finally:
            self.finished_at = time.time()
            self.seconds = time.monotonic() - self._began
            self.meter.planning = False

    def stop(self, timeout: float = 60.0) -> None:
        """End planning before its next store write (the job is over without it: no usable
        node, a placement error), so nothing changes the store under the final report."""
        self._halt.set()
        self.join(timeout)
        if self.is_alive():
            self.say(f"planning did not stop within {timeout:.0f} s; reporting without it")

    def _feed(self, shards: list[Shard]) -> None:
        ray.get(self.queue.add.remote([sh.index for sh in shards]))
        self.meter.total_samples += sum(sh.sample_end - sh.sample_begin for sh in shards)
        self.meter.total_tokens += sum(sh.token_end - sh.token_begin for sh in shards)

    def record(self) -> dict[str, Any]:
        """For the final report: when planning ran, and with how many planners."""
        return {
            "planners": self.planners,
            "started_at": self.started_at,
            "finished_at": self.finished_at,
            "seconds": None if self.seconds is None else round(self.seconds, 3),
            **({"generation": self.generation.to_json()} if self.generation else {}),
        }
