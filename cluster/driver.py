"""The driver: plan or resume the store, run a NodeWorker per server slot, watch, report.

    ray job submit ... -- python -m cluster run --config ray_configs/demo_job.yaml

1. open_or_create: resume the store, or create it (empty) once the job is known to plan a
   sample.
2. one ShardQueueActor with every shard not committed yet; while the plan is incomplete a
   PlanFeed thread streams planned shards into the store and the queue.
3. one NodeWorker per server slot of every alive node advertising `worker.node_resource`
   (cluster/placement.py), pinned to the node and its GPUs and handed the node's plan (its
   server's TP size); nodes that join later get theirs.
4. ray.wait on the workers' run() calls: a lost worker's shards are re-queued at once and its
   slot refilled, up to `worker.max_node_failures` times.
5. when every shard is committed or given up: the final report, in the store and the log.
   Exit status 0 only if every planned sample was written.

Details: docs/running-a-job.md.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections import Counter
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.exceptions import RayActorError, RayError, RayTaskError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from actors.node_plan import NodePlan
from actors.node_worker import NodeWorker, reclaim_after
from cluster.config import JobConfig
from cluster.job_store import open_or_create
from cluster.placement import PlacementError, plan_node, resource_share
from cluster.plan_feed import PlanFeed
from cluster.progress_log import ProgressLog
from cluster.report import ProgressMeter, build_report, format_report
from cluster.shard_queue import QueueStatus, ShardQueueActor
from hsx_store.location import describe_failure

RECLAIM_WAIT_S = 90.0  # the job's end waits this long at most for its nodes' sweeps
STATUS_WAIT_S = 5.0  # for the workers' answers to `status`
CREATION_WAIT_S = 60.0  # a worker is killed once created (see Driver._kill), or after this


@dataclass
class _Running:
    node_id: str
    worker_id: str
    handle: Any
    slot: int = 0  # which of its node's servers (worker.servers_per_node) it runs
    phase: str = "starting"  # as it last answered (actors/node_worker.py `status`)


@dataclass
class Driver:
    config: JobConfig
    say: Any = print
    workers: dict[Any, _Running] = field(default_factory=dict)  # run() ref -> worker
    node_failures: dict[tuple[str, int], int] = field(default_factory=dict)  # (node, slot)
    node_plans: dict[str, NodePlan | PlacementError] = field(default_factory=dict)  # by node
    workers_lost: list[dict[str, str]] = field(default_factory=list)
    # by node: the workers that ended without their own cleanup (killed, failed, stopped);
    # resuming, every node that hosted one of this job's workers is a key
    uncleaned: dict[str, list[str]] = field(default_factory=dict)
    resumed: bool = False  # the store was there: an earlier submission may have left things
    incarnation: int = 0
    gen_queue: Any = None  # a `generate:` job's parts of prompts, while it is planned
    # a terminal: every progress line (the stdout of the moment, not the one at import)
    live: bool = field(default_factory=lambda: sys.stdout.isatty())

    def run(self) -> int:
        started = time.monotonic()
        # The store first: a bad location or config fails in seconds, before Ray is touched.
        store, resumed, builder = open_or_create(self.config, self.say)
        self.resumed = resumed
        if not ray.is_initialized():
            ray.init()
        committed = store.committed()
        todo = [sh for sh in store.shards if not committed[sh.index]]
        if builder is None:
            self.say(f"{len(todo)} of {len(store.shards)} shards to do")
        status, feed = None, None
        if todo or builder is not None:
            q = self.config.queue

            # On the driver's node: Ray may place a 0-CPU actor on any node, and a GPU node
            # lost (the campaign's replace_node) took the queue, and the driver with it.
            driver_node = ray.get_runtime_context().get_node_id()
            here = NodeAffinitySchedulingStrategy(driver_node, soft=False)

            def new_queue(shards: list[int], more_coming: bool, **options: Any) -> Any:
                return ShardQueueActor.options(scheduling_strategy=here).remote(
                    shards,
                    q.lease_s,
                    q.shard_attempts,
                    q.straggler_factor,
                    q.straggler_min_s,
                    margin_seconds=self.config.margin_s,
                    more_coming=more_coming,
                    **options,
                )

            queue = new_queue([sh.index for sh in todo], builder is not None)
            # Parts of prompts to generate: only while a `generate:` job is being planned.
            generating = builder is not None and self.config.generate is not None
            # A part's one write (its responses) follows its claim: see ShardQueue.
            self.gen_queue = new_queue([], True, write_after_claim=True) if generating else None
            done = [sh for sh in store.shards if committed[sh.index]]
            meter = ProgressMeter(
                total_samples=store.num_samples,
                total_tokens=int(store.sample_length.sum()),
                done_samples=sum(sh.sample_end - sh.sample_begin for sh in done),
                done_tokens=sum(sh.token_end - sh.token_begin for sh in done),
                planning=builder is not None,
            )
            if builder is not None:
                planners = self.config.driver.planners  # None: every CPU that holds the data
                feed = PlanFeed(
                    builder, self.config, queue, meter, planners, self.say, self.gen_queue
                )
                feed.start()  # workers start below meanwhile
            try:
                status = self._watch(queue, meter, feed)
            finally:
                if feed is not None and feed.is_alive():
                    feed.stop()
                ray.kill(queue)
                if self.gen_queue is not None:
                    ray.kill(self.gen_queue)
                self._reclaim_nodes()
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
                "planning": feed.record() if feed else None,
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

    def _watch(self, queue: Any, meter: ProgressMeter, feed: PlanFeed | None) -> QueueStatus:
        interval = self.config.driver.progress_interval_s
        progress = ProgressLog(self.say, self.config.driver.log_interval_s, self.live)
        started, finished_at = time.monotonic(), None
        while True:
            if feed is not None and feed.error is not None:
                self._stop_workers("planning failed")
                raise feed.error
            status: QueueStatus = ray.get(queue.status.remote())
            if status.finished and not self.workers:
                progress.finish(self._progress(meter, queue)[0])  # the line it ends on, once
                return status
            if not status.finished:  # once finished, the workers stop on their own
                self._start_missing_workers(queue)
            elif finished_at is None:
                finished_at = time.monotonic()
                self._stop_starting_workers()
            elif time.monotonic() - finished_at > self.config.driver.finish_grace_s:
                self._stop_lingering_workers()
                continue
            if not self.workers:
                if status.finished:
                    continue  # its last workers were stopped: it ends above, on its last line
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
            # Once every shard is done the line changes only as workers stop: one line per
            # stop said the same progress over again. The job's last line comes once, above.
            line, state, committed, finished = self._progress(meter, queue)
            if not finished:
                progress.update(line, state, committed)

    def _stop_workers(self, why: str) -> None:
        for running in self.workers.values():
            self.say(f"{running.worker_id}: stopping it ({why})")
        self._kill(*self.workers.values())
        self.workers.clear()

    def _stop_starting_workers(self) -> None:
        """Once every shard is done, a worker still starting holds no shard and has nothing to
        finish: stopped at once rather than waited for until its server is up. Asked afresh
        (its last answer may be a tick old); one that does not answer within seconds is an
        actor whose process is still coming up."""
        asked = {w.handle.status.remote(): (ref, w) for ref, w in self.workers.items()}
        answered, silent = ray.wait(list(asked), num_returns=len(asked), timeout=STATUS_WAIT_S)
        starting = [asked[state] for state in silent]
        for state in answered:
            with contextlib.suppress(RayError):  # a worker that just stopped: reaped as usual
                if ray.get(state)["phase"] == "starting":
                    starting.append(asked[state])
        for ref, worker in starting:
            self.say(f"{worker.worker_id}: stopping it (still starting when every shard was done)")
            del self.workers[ref]
        self._kill(*(worker for _, worker in starting))

    def _stop_lingering_workers(self) -> None:
        for running in self.workers.values():
            self.say(
                f"{running.worker_id}: still busy {self.config.driver.finish_grace_s:.0f} s after "
                "every shard was done (a straggler whose shard a duplicate committed); stopping it"
            )
        self._kill(*self.workers.values())
        self.workers.clear()

    def _kill(self, *workers: _Running) -> None:
        """Stop workers at once. No cleanup of their own runs (Ray documents it): the node's
        sweep at the job's end (_reclaim_nodes) removes what they left, but only what is there
        when it looks. So an actor is killed only once created (a call of it answered, or its
        failure known): Ray promises no order between a kill and a creation under way, and a
        worker whose __init__ ended after the sweep looked would leave folders no sweep sees
        (the likeliest reading of a CI campaign's leftover: a worker's empty dump folder and
        its server's log, made seconds before the job's end). One not created within
        CREATION_WAIT_S is killed anyway, and said."""
        if not workers:
            return
        created = {w.handle.status.remote(): w for w in workers}
        _, late = ray.wait(list(created), num_returns=len(created), timeout=CREATION_WAIT_S)
        for ref in late:
            self.say(
                f"{created[ref].worker_id}: not created within {CREATION_WAIT_S:.0f} s; killed "
                "anyway (what it makes after is removed by its node's next worker)"
            )
        for running in workers:
            ray.kill(running.handle, no_restart=True)
            self.uncleaned.setdefault(running.node_id, []).append(running.worker_id)

    def _reclaim_nodes(self) -> None:
        """On each node where this job's workers ended without their cleanup, remove what they
        left once they are gone (actors/node_worker.py `reclaim_after`); resuming, on every
        node it had workers on, what an earlier submission's workers left: killed with their
        driver, they can die after every worker here last looked. A node lost meanwhile is
        skipped."""
        sweeps = {
            reclaim_after.options(
                scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)
            ).remote(self.config.worker, worker_ids): node_id
            for node_id, worker_ids in self.uncleaned.items()
        }
        if not sweeps:
            return
        ready, late = ray.wait(list(sweeps), num_returns=len(sweeps), timeout=RECLAIM_WAIT_S)
        removed, problems = 0, []
        for ref in ready:
            node = sweeps[ref][:8]
            try:
                count, held = ray.get(ref)
            except RayTaskError as exc:  # the sweep itself failed: said, the job goes on
                problems.append(f"node {node}: its sweep failed: {str(exc).splitlines()[-1]}")
                continue
            except RayError:  # the node is gone, and what it held with it
                continue
            removed += count
            if held:
                problems.append(
                    f"node {node}: {', '.join(held)} still held after their workers were "
                    "stopped (the node's next worker removes them)"
                )
        problems += [
            f"node {sweeps[ref][:8]}: its sweep did not end within {RECLAIM_WAIT_S:.0f} s"
            for ref in late
        ]
        if removed:
            self.say(f"removed {removed} folder(s) that stopped or lost workers left behind")
        for problem in problems:
            self.say(problem)

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
        if self.gen_queue is not None:  # its parts of prompts too, at once, not at expiry
            parts = ray.get(self.gen_queue.release_worker.remote(running.worker_id, reason))
            if parts:
                self.say(f"{running.worker_id}: parts of prompts {parts} back in the queue")
        slot = (running.node_id, running.slot)
        self.node_failures[slot] = self.node_failures.get(slot, 0) + 1
        self.workers_lost.append({"worker": running.worker_id, "reason": detail[-2000:]})
        self.say(
            f"{running.worker_id}: {reason}; shards {shards} back in the queue "
            f"(failures in its slot {self.node_failures[slot]}"
            f"/{self.config.worker.max_node_failures})\n{detail[-2000:]}"
        )
        self._kill(running)  # a failed actor may still hold its server

    def _usable_nodes(self) -> list[tuple[dict[str, Any], NodePlan]]:
        """Alive nodes advertising `worker.node_resource`, with the servers each hosts. A node
        too small for them is said once and left out; if no node can host one, the job stops
        (a config error) rather than wait for a node that fits."""
        resource = self.config.worker.node_resource
        nodes = [n for n in ray.nodes() if n["Alive"] and n["Resources"].get(resource, 0) >= 1]
        plans = [(n, self._node_plan(n)) for n in nodes]
        usable = [(n, plan) for n, plan in plans if isinstance(plan, NodePlan)]
        if nodes and not usable and not self.workers:
            raise PlacementError(
                "no node can host a server:\n" + "\n".join(str(p) for _, p in plans)
            )
        return usable

    def _node_plan(self, node: dict[str, Any]) -> NodePlan | PlacementError:
        """Planned once per node: its GPUs do not change while it lives."""
        node_id = node["NodeID"]
        if node_id not in self.node_plans:
            s, w = self.config.server, self.config.worker
            name = f"{node['NodeManagerAddress']} ({node_id[:8]})"
            gpus = int(node["Resources"].get("GPU", 0))
            try:
                plan = plan_node(name, gpus, s.tp_size, s.dp_size, w.servers_per_node)
            except PlacementError as exc:
                self.say(f"{exc}: no server there")
                plan = exc
            else:
                self.say(
                    f"node {name}: {plan.servers} server(s) of {plan.gpus_per_server} GPU(s)"
                    + (f", {plan.idle_gpus} GPU(s) left idle" if plan.idle_gpus else "")
                )
            self.node_plans[node_id] = plan
        return self.node_plans[node_id]

    def _start_missing_workers(self, queue: Any) -> None:
        """A worker for every free slot of every usable node: a lost worker's replacement
        takes its slot, unless that slot lost `worker.max_node_failures` workers already."""
        busy = {(r.node_id, r.slot) for r in self.workers.values()}
        limit = self.config.worker.max_node_failures
        for node, plan in self._usable_nodes():
            for slot in range(plan.servers):
                key = (node["NodeID"], slot)
                if key not in busy and self.node_failures.get(key, 0) < limit:
                    self._start_worker(node, plan, slot, queue)

    def _start_worker(self, node: dict[str, Any], plan: NodePlan, slot: int, queue: Any) -> None:
        self.incarnation += 1
        node_id = node["NodeID"]
        worker_id = f"{node['NodeManagerAddress']}-{node_id[:8]}-s{slot}-w{self.incarnation}"
        handle = NodeWorker.options(
            # A share of the node's resource per server, so the node takes exactly its servers.
            resources={self.config.worker.node_resource: resource_share(plan.servers)},
            # Its GPU group: Ray points CUDA_VISIBLE_DEVICES at those GPUs (with none requested
            # it would hide them), and the server inherits that and uses its devices 0..n-1.
            num_gpus=plan.gpus_per_server,
            # None of Ray's CPUs: an actor given resources otherwise holds one CPU while it
            # lives, and a node with fewer CPUs than servers started its next server only
            # once one died (measured on the tests' 1-CPU nodes: two servers, one at a time).
            num_cpus=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
            max_restarts=0,
        ).remote(self.config, queue, worker_id, self.gen_queue, plan=plan, slot=slot)
        self.workers[handle.run.remote()] = _Running(node_id, worker_id, handle, slot)
        if self.resumed:
            self.uncleaned.setdefault(node_id, [])
        self.say(f"started {worker_id}")

    def _progress(self, meter: ProgressMeter, queue: Any) -> tuple[str, Hashable, int, bool]:
        """The progress line, the job's state (the workers' phases and whether planning goes
        on; None: unknown this time) and the shards committed, as ProgressLog takes them, and
        whether the queue was finished when read (the line is then the job's last). Workers
        first, then the queue: a shard committed between the two reads is then in the queue's
        summaries, where its worker's state might no longer show it; the other way round it
        was counted in neither and the count went backwards."""
        asked = {r.handle.status.remote(): r for r in self.workers.values()}
        answered, _ = (
            ray.wait(list(asked), num_returns=len(asked), timeout=5) if asked else ([], [])
        )
        states = []
        for ref in answered:
            try:
                answer = ray.get(ref)
            except RayError:
                continue  # a worker busy dying: the next line catches up
            asked[ref].phase = answer["phase"]
            states.append(answer)
        status: QueueStatus = ray.get(queue.status.remote())
        # Samples of shards still in progress (a finished shard is in the summaries already).
        in_flight = sum(s["written"] for s in states if s["shard"] not in status.summaries)
        # A worker slow to answer (its process still coming up) counts as it last answered.
        phases = Counter(r.phase for r in asked.values())
        line = meter.line(list(status.summaries.values()), in_flight, dict(phases))
        known = len(states) == len(asked)
        state = (tuple(sorted(phases.items())), meter.planning) if known else None
        return line, state, len(status.summaries), status.finished


def run_job(config: JobConfig, say: Any = print) -> int:
    return Driver(config, say).run()
