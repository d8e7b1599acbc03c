"""The driver: plan or resume the store, run one NodeWorker per GPU node, watch, report.

    ray job submit ... -- python -m cluster run --config ray_configs/demo_job.yaml

1. open_or_create: plan + create the store (storage estimate first), or resume it.
2. one ShardQueueActor (num_cpus=0) with every shard not committed yet.
3. one NodeWorker per alive node advertising `worker.node_resource`, pinned to it; nodes that
   join later get one too (scale out by adding nodes while the job runs).
4. ray.wait on the workers' run() calls: a worker that dies or fails has its shards re-queued
   at once (lease expiry is only the backstop) and, while its node is alive and has failed
   fewer than `worker.max_node_failures` times, a replacement.
5. when every shard is committed or given up: the final report, as JSON in the store and as a
   table in the log. Exit status 0 only if every planned sample was written.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from actors.node_worker import NodeWorker, WorkerConfig
from cluster.config import JobConfig
from cluster.job_store import open_or_create
from cluster.report import ProgressMeter, build_report, format_report
from cluster.shard_queue import QueueStatus, ShardQueueActor
from store.location import describe_failure


def worker_config(config: JobConfig) -> WorkerConfig:
    m, s, w = config.model, config.server, config.worker
    return WorkerConfig(
        model_path=m.path,
        store_url=config.store.url,
        storage_options=config.store.storage_options,
        aux_layer_ids=m.aux_layer_ids,
        tp_size=s.tp_size,
        server_args=[
            "--dtype",
            m.dtype,
            *(["--trust-remote-code"] if m.trust_remote_code else []),
            *s.extra_args,
        ],
        trust_remote_code=m.trust_remote_code,
        max_total_tokens=s.max_total_tokens,
        inflight=w.inflight,
        sample_attempts=w.sample_attempts,
        server_start_timeout=s.start_timeout_s,
        server_restarts=s.restarts,
        restart_backoff=s.restart_backoff_s,
        request_timeout=s.request_timeout_s,
        heartbeat_seconds=w.heartbeat_s,
        dump_root=w.dump_root,
        log_root=w.log_root,
        max_pending_bytes=w.max_pending_bytes,
        writer_threads=w.writer_threads,
        fence_timeout=config.queue.lease_s * 5,
    )


@dataclass
class _Running:
    node_id: str
    worker_id: str
    handle: Any


@dataclass
class Driver:
    config: JobConfig
    say: Any = print
    workers: dict[Any, _Running] = field(default_factory=dict)  # run() ref -> worker
    node_failures: dict[str, int] = field(default_factory=dict)
    workers_lost: list[dict[str, str]] = field(default_factory=list)
    incarnation: int = 0

    def run(self) -> int:
        started = time.monotonic()
        # The store first: a bad location or config fails in seconds, before Ray is touched.
        store, resumed = open_or_create(self.config, self.say)
        if not ray.is_initialized():
            ray.init()
        committed = store.committed()
        todo = [sh for sh in store.shards if not committed[sh.index]]
        self.say(f"{len(todo)} of {len(store.shards)} shards to do")
        status = None
        if todo:
            q = self.config.queue
            queue = ShardQueueActor.remote(
                [sh.index for sh in todo],
                q.lease_s,
                q.shard_attempts,
                q.straggler_factor,
                q.straggler_min_s,
            )
            done = [sh for sh in store.shards if committed[sh.index]]
            meter = ProgressMeter(
                total_samples=store.num_samples,
                total_tokens=int(store.sample_length.sum()),
                done_samples=sum(sh.sample_end - sh.sample_begin for sh in done),
                done_tokens=sum(sh.token_end - sh.token_begin for sh in done),
            )
            try:
                status = self._watch(queue, worker_config(self.config), meter)
            finally:
                ray.kill(queue)
        summaries = status.summaries if status else {}
        report = build_report(
            store,
            {
                "store_url": self.config.store.url,
                "resumed": resumed,
                "seconds": time.monotonic() - started,
                "completed": list(summaries.values()),
                # Shards that failed and never completed: given up, or left when no node was.
                "given_up": {
                    str(k): v
                    for k, v in (status.failures if status else {}).items()
                    if k not in summaries
                },
                "workers_lost": self.workers_lost,
            },
        )
        self.say(format_report(report))
        try:
            store.group.attrs["report"] = report  # the workers are done: one writer again
        except Exception as exc:  # a store that no longer takes writes: the log has the report
            store_options = self.config.store.storage_options
            self.say(
                "could not keep the report in the store: "
                + describe_failure(self.config.store.url, exc, store_options)
            )
            return 1
        return 0 if report["ok"] else 1

    # -- watching ---------------------------------------------------------------------------

    def _watch(self, queue: Any, wconfig: WorkerConfig, meter: ProgressMeter) -> QueueStatus:
        interval = self.config.driver.progress_interval_s
        started, finished_at = time.monotonic(), None
        while True:
            status: QueueStatus = ray.get(queue.status.remote())
            if status.finished and not self.workers:
                return status
            if not status.finished:  # once finished, the workers stop on their own
                self._start_missing_workers(wconfig, queue)
            elif finished_at is None:
                finished_at = time.monotonic()
            elif time.monotonic() - finished_at > self.config.driver.finish_grace_s:
                self._stop_lingering_workers()
                continue
            if not self.workers:
                given_up = any(
                    n >= self.config.worker.max_node_failures for n in self.node_failures.values()
                )
                if given_up or time.monotonic() - started > self.config.driver.node_wait_s:
                    self.say(
                        f"no usable node with resource {self.config.worker.node_resource!r}; "
                        f"stopping with {status.total - status.completed} shards not done"
                    )
                    return status
                time.sleep(min(interval, 1.0))
                continue
            done, _ = ray.wait(list(self.workers), num_returns=1, timeout=interval)
            for ref in done:
                self._reap(ref, queue)
            self.say(self._progress_line(meter, queue))

    def _stop_lingering_workers(self) -> None:
        for ref, running in list(self.workers.items()):
            self.say(
                f"{running.worker_id}: still busy {self.config.driver.finish_grace_s:.0f} s after "
                "every shard was done (a straggler whose shard a duplicate committed); stopping it"
            )
            ray.kill(running.handle, no_restart=True)
            del self.workers[ref]

    def _reap(self, ref: Any, queue: Any) -> None:
        running = self.workers.pop(ref)
        try:
            ray.get(ref)
            return  # the queue is finished: the worker stopped on its own
        except RayActorError as exc:
            reason = f"worker died: {exc.__class__.__name__}"
            detail = str(exc).splitlines()[0] if str(exc) else reason
        except RayError as exc:
            reason = f"worker failed: {exc.__class__.__name__}"
            detail = str(exc)
        shards = ray.get(queue.release_worker.remote(running.worker_id, reason))
        self.node_failures[running.node_id] = self.node_failures.get(running.node_id, 0) + 1
        self.workers_lost.append({"worker": running.worker_id, "reason": detail[-2000:]})
        self.say(
            f"{running.worker_id}: {reason}; shards {shards} back in the queue "
            f"(node failures {self.node_failures[running.node_id]}"
            f"/{self.config.worker.max_node_failures})\n{detail[-2000:]}"
        )
        ray.kill(running.handle, no_restart=True)  # a failed actor may still hold its server

    def _usable_nodes(self) -> list[dict[str, Any]]:
        resource = self.config.worker.node_resource
        return [
            n
            for n in ray.nodes()
            if n["Alive"]
            and n["Resources"].get(resource, 0) >= 1
            and self.node_failures.get(n["NodeID"], 0) < self.config.worker.max_node_failures
        ]

    def _start_missing_workers(self, wconfig: WorkerConfig, queue: Any) -> None:
        busy = {r.node_id for r in self.workers.values()}
        for node in self._usable_nodes():
            if node["NodeID"] in busy:
                continue
            self.incarnation += 1
            worker_id = f"{node['NodeManagerAddress']}-{node['NodeID'][:8]}-w{self.incarnation}"
            handle = NodeWorker.options(
                resources={self.config.worker.node_resource: 1},
                # All the node's GPUs: Ray then points CUDA_VISIBLE_DEVICES at them (with none
                # requested it would hide them), and the server inherits that.
                num_gpus=node["Resources"].get("GPU", 0),
                scheduling_strategy=NodeAffinitySchedulingStrategy(node["NodeID"], soft=False),
                max_restarts=0,
            ).remote(wconfig, queue, worker_id)
            self.workers[handle.run.remote()] = _Running(node["NodeID"], worker_id, handle)
            self.say(f"started {worker_id}")

    def _progress_line(self, meter: ProgressMeter, queue: Any) -> str:
        """Workers first, then the queue: a shard committed between the two reads is then in
        the queue's summaries, where its worker's state might no longer show it; the other way
        round it was counted in neither and the count went backwards."""
        refs = [r.handle.status.remote() for r in self.workers.values()]
        try:
            states = ray.get(refs, timeout=5)
        except (GetTimeoutError, RayError):
            states = []  # a worker busy dying: the next line catches up
        status: QueueStatus = ray.get(queue.status.remote())
        # Samples of shards still in progress (a finished shard is in the summaries already).
        in_flight = sum(s["written"] for s in states if s["shard"] not in status.summaries)
        phases = Counter(s["phase"] for s in states)
        return meter.line(list(status.summaries.values()), in_flight, dict(phases))


def run_job(config: JobConfig, say: Any = print) -> int:
    return Driver(config, say).run()
