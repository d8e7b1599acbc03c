"""The per-node Ray actor: owns one patched SGLang server and turns leased shards into rows.

    worker = NodeWorker.options(resources={"sglang_node": 1}, num_cpus=0).remote(
        config, queue, plan=NodePlan.on_cpu(1, None)
    )
    summaries = ray.get(worker.run.remote())     # until every shard is done

run(): start the server (on the GPU group Ray gave this worker, at the TP size of the
driver's placement, actors/node_plan.py; CPU flags on a CPU node) -> calibrate ->
loop: lease a shard -> K requests in flight -> read + verify each dump -> hand rows to the shard
writer -> claim + commit -> complete the lease. With nothing to lease it waits (a dead worker's
shards or a straggler may still come its way) until the queue says the job is finished. The
server is restarted (bounded, with backoff) and calibrated again when it dies; the shard then
resumes with its unwritten samples. A job with `generate:` also runs a generation thread: it
leases parts of prompts from the generation queue, has the same server write their responses
(batched with the capture's requests) and keeps them in the store's location
(actors/generator.py). Design: docs/design/node-worker.md, docs/design/generation.md.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import socket
import tempfile
import threading
import time
import uuid
from collections import Counter
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
import requests
import torch
from transformers import AutoTokenizer

from actors.calibration import PROBE_TEXT, calibrate
from actors.calibration_result import Calibration
from actors.capture_client import (
    CaptureError,
    CaptureResponse,
    generate_and_capture,
    wait_for_dump,
)
from actors.config import WorkerConfig, WorkerJobConfig
from actors.dump_checks import DumpMismatch, check_dump
from actors.generator import PartGeneration, PromptImages
from actors.lease_keeper import Lease, LeaseKeeper, LeaseLost, ray_caller
from actors.node_plan import NodePlan
from actors.planned_sample import PlannedSample, image_urls, planned_samples
from actors.private_folders import HeldFolder, reclaim_abandoned
from actors.process_group import reclaim_orphan_segments, young_orphan_segments
from actors.sglang_server import ServerError, ServerSpec, SGLangServer
from actors.shard_writer import ShardWriter
from actors.worker_metrics import WorkerMetrics
from hsx_store.format import Store
from hsx_store.fp8 import FP8_DTYPE, Fp8Rows, scale_name
from hsx_store.generated import GeneratedParts
from hsx_store.model_identity import model_mismatches
from patches.dump_files import TMP_PREFIX, clear_unpublished, read_dump, release_dump
from patches.settings import CaptureSettings

logger = logging.getLogger(__name__)


RID_PREFIX = "hsx-"  # the plugin captures only requests whose rid starts with it
DUMPS_PREFIX, LOGS_PREFIX = "hsx-dumps-", "hsx-worker-"  # a worker's folders on its node


class WorkerStopping(RuntimeError):
    """A server restart asked for once the worker began to stop."""


class ModelMismatch(RuntimeError):
    """The node's model is not the store's (its config, tokenizer or weights differ)."""


@dataclass(frozen=True)
class Captured:
    # the dump's rows of each hidden array the store keeps (quantized by the server: Fp8Rows)
    states: tuple[torch.Tensor | Fp8Rows, ...]
    dump_path: Path


@dataclass
class _ActivePart:
    """A part of prompts being generated: its lease, the keeper renewing it, its requests (None:
    its responses were kept already)."""

    lease: Lease
    keeper: LeaseKeeper
    generation: PartGeneration | None

    @property
    def outstanding(self) -> int:
        return self.generation.outstanding if self.generation else 0

    def close(self, queue: Any, why: str) -> None:
        """Give the part back unfinished (its requests cancelled)."""
        if self.generation is not None:
            self.generation.cancel()
        self.keeper.__exit__(None, None, None)
        with contextlib.suppress(Exception):  # a queue gone with the job: nothing to tell
            ray.get(queue.release.remote(self.lease.lease_id, why))


@ray.remote(max_concurrency=4)  # run() is long; status and server_pid answer meanwhile
class NodeWorker:
    def __init__(
        self,
        job: WorkerJobConfig,
        queue: Any,
        worker_id: str | None = None,
        gen_queue: Any = None,
        *,
        plan: NodePlan,
        slot: int = 0,
    ) -> None:
        """`plan`: the placement of its node (the driver's; a worker started on its own is
        given one: NodePlan.on_cpu on a CPU). `slot`: which of the node's servers it runs."""
        self.job, self.config = job, job.worker
        self.plan, self.slot = plan, slot
        self.queue, self.gen_queue = queue, gen_queue  # gen_queue: parts of prompts (generate:)
        self.id = worker_id or f"{socket.gethostname()}-{os.getpid()}"
        self.store = Store.open(job.store.url, mode="r+", storage_options=job.store.storage_options)
        tokenizer = AutoTokenizer.from_pretrained(
            job.model.path, trust_remote_code=job.model.trust_remote_code
        )
        self.probe_ids: list[int] = tokenizer(PROBE_TEXT)["input_ids"]
        # Private folders, locked while this worker lives: what a killed worker left on this
        # node goes first (actors/private_folders.py). Dumps in /dev/shm (RAM), the server's log
        # on disk, kept a while if the worker failed.
        reclaim_node(self.config)
        self.dumps = HeldFolder.claim(dump_root(self.config), f"{DUMPS_PREFIX}{self.id}-")
        self.logs = HeldFolder.claim(log_root(self.config), f"{LOGS_PREFIX}{self.id}-")
        self.dump_dir, self.log_dir = self.dumps.path, self.logs.path
        self.server_dumps = self.dump_dir / "server-0"  # this server start's (see _start_server)
        self.server: SGLangServer | None = None
        self.calibration: Calibration | None = None
        self.metrics = WorkerMetrics(self.id)
        self.restarts = 0
        self._server_lock = threading.Lock()  # restarts: the capture or the generation thread
        self._stopping = threading.Event()
        self._generation_error: BaseException | None = None
        self.generating: list[int] = []  # the parts of prompts being generated
        # starting (server + calibration) | working (a shard) | generating (parts only) | idle
        self.phase = "starting"
        self.progress: dict[str, Any] = {"shard": None, "written": 0, "failed": 0}

    # -- Ray API ------------------------------------------------------------------------------

    def run(self) -> list[dict[str, Any]]:
        """Process shards until the queue has none left; per-shard summaries."""
        summaries = []
        generation = None
        try:
            self._check_model()
            self._start_server()
            if self.gen_queue is not None:  # generating next to capturing: one server, both
                generation = threading.Thread(
                    target=self._generate_parts, name="generation", daemon=True
                )
                generation.start()
            idle = 0  # polls in a row that found nothing
            while True:
                if self._generation_error is not None:
                    raise self._generation_error
                lease = ray.get(self.queue.acquire.remote(self.id))
                if lease is not None:
                    idle = 0
                    summaries.append(self._process(lease))
                elif ray.get(self.queue.finished.remote()):
                    break
                else:
                    self.phase = "generating" if self.generating else "idle"
                    self.progress = {"shard": None, "written": 0, "failed": 0}
                    # Backing off (1x, 2x, 4x): a thousand idle nodes at a job's tail or
                    # ahead of its plan stay a small share of what one queue answers. While
                    # this worker generates, its own parts become shards soon: ask often.
                    backoff = 2 ** min(idle, 2) if not self.generating else 0.25
                    time.sleep(self.config.idle_poll_s * backoff)
                    idle += 1
        except BaseException as exc:
            self._stop_generation(generation)
            self.shutdown(keep_log=True)
            exc.add_note(f"worker {self.id}: the SGLang server's log is kept at {self.server_log}")
            raise
        self._stop_generation(generation)
        self.shutdown()
        return summaries

    def server_pid(self) -> int | None:
        return self.server.process.pid if self.server and self.server.process else None

    def status(self) -> dict[str, Any]:
        return {
            "worker": self.id,
            "phase": self.phase,
            "generating": self.generating,
            "restarts": self.restarts,
            "dumps_held": self._dumps_held(),
            **self.progress,
        }

    def _dumps_held(self) -> int:
        """Dumps published or being published and not yet released (they hold /dev/shm, and
        on GPU count against max_pending_bytes)."""
        held = ("req_", f"{TMP_PREFIX}req_")
        return sum(
            p.name.startswith(held)
            for pattern in ("server-*/*", "server-*/dp*/*")  # dp*: a DP rank's own folder
            for p in self.dump_dir.glob(pattern)
        )

    @property
    def server_log(self) -> Path:
        return self.log_dir / "server.log"

    def shutdown(self, keep_log: bool = False) -> None:
        """Stop the server and release the folders. A restart under way in the generation
        thread (its join may time out) is waited for, and none begins after: one that raced
        this left a server running and its folders made anew after their release."""
        self._stopping.set()
        with self._server_lock:
            if self.server is not None:
                self.server.stop()
                self.server = None
        self.dumps.release()
        self.logs.release(remove=not keep_log)
        reclaim_node(self.config)  # what workers killed meanwhile left (at a job's end: all)

    def _check_model(self) -> None:
        """Refuse to extend the store with another checkpoint than the one that planned it (a
        node whose copy at model.path differs: a fine-tune, another revision)."""
        if problems := model_mismatches(self.job.model.path, self.store.manifest):
            raise ModelMismatch(
                f"worker {self.id}: the model on this node is not the one the store was planned "
                "with:\n  " + "\n  ".join(problems)
            )

    # -- server lifecycle ---------------------------------------------------------------------

    def _start_server(self) -> None:
        """Start a server and calibrate it. Each start dumps into a folder of its own: a
        restarted server numbers its dumps from 0 again, and must never meet a name the dead
        one left. What that one never published is removed first; its published dumps still
        lent to the writer are released as usual."""
        self.phase = "starting"
        for earlier in self.dump_dir.glob("server-*"):  # every server there is gone by now
            for root in (*earlier.glob("dp*/"), earlier):  # a writer's root per DP rank
                clear_unpublished(root)
                with contextlib.suppress(OSError):  # empty: nothing of it is held any more
                    root.rmdir()
        self.server_dumps = self.dump_dir / f"server-{self.restarts}"
        on_gpu = self.plan.gpus_per_server > 0
        server = self.job.server
        spec = ServerSpec(
            model_path=Path(self.job.model.path),
            capture=CaptureSettings(
                self.server_dumps,
                RID_PREFIX,
                self.config.max_pending_bytes,
                mla_cpu_fix=True,
                max_tokens=self.store.manifest.max_length,
                quantize=self._server_quantizes(),
            ),
            aux_layer_ids=self.job.model.aux_layer_ids,
            tp_size=self._tp_size(),
            dp_size=server.dp_size,
            max_total_tokens=server.max_total_tokens or (None if on_gpu else 8192),
            extra_args=self.job.server_args(),
            device="cuda" if on_gpu else "cpu",
        )
        self.server = SGLangServer(spec, self.server_log).start(server.start_timeout_s)
        self.dumps.list_shm_files(self.server.shm_files)  # should this worker be killed
        self.calibration = calibrate(
            self.server,
            self.store.manifest,
            self.probe_ids,
            spec.capture.rid_prefix,
        )

    def _server_quantizes(self) -> str | None:
        """An FP8 store's rows are quantized in the server unless the job asks for the
        writer (actors/config.py `fp8_quantizer`)."""
        fp8 = self.store.manifest.dtype == FP8_DTYPE
        return FP8_DTYPE if fp8 and self.job.store.fp8_quantizer == "server" else None

    def _fp8_quantized_by(self) -> str | None:
        """Who quantized this worker's rows of an FP8 store: "server" or "writer"."""
        if self.store.manifest.dtype != FP8_DTYPE:
            return None
        quantized = self.calibration is not None and self.calibration.quantized
        return "server" if quantized else "writer"

    def _tp_size(self) -> int:
        """The server's TP size: the placement's (NodePlan). Ray pins this worker to its GPU
        group (num_gpus), so the GPUs it sees, CUDA_VISIBLE_DEVICES inherited by the server,
        are that group; seeing fewer is refused here rather than by SGLang mid-start."""
        plan, dp = self.plan, self.job.server.dp_size
        if plan.gpus_per_server:
            visible = torch.cuda.device_count()
            if visible < plan.gpus_per_server:
                raise ServerError(
                    f"worker {self.id}: tp_size {plan.tp_size} x dp_size {dp} needs more "
                    f"GPUs than the {visible} it was given (Ray GPU ids {ray.get_gpu_ids()}, "
                    f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})"
                )
            logger.info(
                "worker %s (slot %d of %d): tp %d x dp %d on GPUs %s",
                self.id,
                self.slot,
                plan.servers,
                plan.tp_size,
                dp,
                ray.get_gpu_ids(),
            )
        return plan.tp_size

    def _restart_server(self) -> None:
        """Bounded attempts with backoff; the last failure carries the server's log tail."""
        with self._server_lock:
            if not self._server_ok():  # else the other thread restarted it meanwhile
                self._restart_server_locked()

    def _restart_server_locked(self) -> None:
        tail = None
        while True:
            # shutdown() takes this lock too: once it is stopping, no start begins.
            if self._stopping.is_set() or self.server is None:
                raise WorkerStopping(f"worker {self.id} is stopping: its server is not restarted")
            tail = self.server.log_tail() if tail is None else tail
            self.restarts += 1
            self.metrics.restarts.inc()
            if self.restarts > self.job.server.restarts:
                raise ServerError(
                    f"worker {self.id}: SGLang server died and {self.job.server.restarts} "
                    f"restarts are used up; its log ended with:\n{tail}"
                )
            self.server.stop()
            time.sleep(self.job.server.restart_backoff_s * self.restarts)
            try:
                self._start_server()
                return
            except ServerError as exc:
                tail = str(exc)

    # -- one part of prompts (generate:) -------------------------------------------------------

    def _generate_parts(self) -> None:
        """The generation thread: parts of prompts leased one after another, their requests
        sharing K threads (generate.inflight) and batching on the server with the capture's;
        a part is leased as soon as the one before leaves a thread idle (two at most). Its
        failure is the worker's."""
        assert self.gen_queue is not None and self.job.generate is not None
        inflight = self.job.generate.inflight or 4 * self.config.inflight
        pool = ThreadPoolExecutor(inflight, thread_name_prefix="generate")
        active: list[_ActivePart] = []
        idle = 0
        try:
            while not self._stopping.is_set():
                for part in [p for p in active if p.outstanding == 0]:
                    active.remove(part)
                    self._finish_part(part)
                room = len(active) < 2 and sum(p.outstanding for p in active) < inflight
                lease = ray.get(self.gen_queue.acquire.remote(self.id)) if room else None
                if lease is not None:
                    active.append(self._start_part(lease, pool))
                    idle = 0
                elif active:
                    futures = [f for p in active if p.generation for f in p.generation.futures]
                    wait(futures, timeout=self.config.idle_poll_s, return_when=FIRST_COMPLETED)
                else:
                    self._stopping.wait(self.config.idle_poll_s * 2 ** min(idle, 2))
                    idle += 1
                self.generating = [p.lease.shard for p in active]
        except BaseException as exc:
            self._generation_error = exc
        finally:
            for part in active:  # the worker is stopping: the parts go back at once
                part.close(self.gen_queue, "the worker stopped")
            pool.shutdown(wait=False, cancel_futures=True)
            self.generating = []

    def _start_part(self, lease: Lease, pool: ThreadPoolExecutor) -> _ActivePart:
        """Hold part `lease.shard`'s lease and submit its requests; a part whose responses are
        kept already (a duplicate lease, a resumed job) is only completed."""
        assert self.job.generate is not None
        keep = GeneratedParts(self.store.group.store)
        keeper = LeaseKeeper(ray_caller(self.gen_queue), lease, self.config.heartbeat_s)
        keeper.__enter__()
        generation = None
        try:
            if keep.responses(lease.shard) is None:
                urls = image_urls(self.store)
                token = self.store.manifest.image_token_id
                generation = PartGeneration(
                    pool,
                    self.server,
                    keep.prompts(lease.shard),
                    self.job.generate,
                    self.config.sample_attempts,
                    self.job.server.request_timeout_s,
                    None if urls is None or token is None else PromptImages(token, urls),
                )
        except BaseException:
            keeper.__exit__(None, None, None)
            raise
        return _ActivePart(lease, keeper, generation)

    def _finish_part(self, part: _ActivePart) -> None:
        """Keep a part's responses in the store's location, once: the first claim wins, as a
        shard's commit does. A server that died meanwhile is restarted and the part given
        back (generated again, here or elsewhere)."""
        assert self.gen_queue is not None
        lease, keeper = part.lease, part.keeper
        try:
            record = part.generation.record() if part.generation else None
            keeper.claim_commit(lease.claim_timeout)
            if record is not None:
                record["model"] = self._model_identity()
                record["worker"] = self.id
                with keeper.writing():
                    GeneratedParts(self.store.group.store).put_responses(lease.shard, record)
        except LeaseLost as exc:
            self._lease_lost(lease, exc)
            return
        except requests.RequestException as exc:  # the server's failure, not the part's
            self._give_back(lease, exc)
            self._restart_server()  # unless it is fine, or restarted meanwhile
            return
        except BaseException as exc:
            self._give_back(lease, exc)
            raise
        finally:
            keeper.__exit__(None, None, None)
        summary = {"part": lease.shard, "worker": self.id, "generated": record is not None}
        if not ray.get(self.gen_queue.complete.remote(lease.lease_id, summary)):
            self._lease_lost(lease, "the queue refused the completion")

    def _stop_generation(self, generation: threading.Thread | None) -> None:
        """At the job's end it is idle; after a failure it may be mid-part: that part's lease
        runs out and the part is generated elsewhere."""
        self._stopping.set()
        if generation is not None:
            generation.join(timeout=30)

    def _give_back(self, lease: Lease, exc: BaseException) -> None:
        assert self.gen_queue is not None
        ray.get(self.gen_queue.release.remote(lease.lease_id, f"{type(exc).__name__}: {exc}"))

    def _model_identity(self) -> dict[str, Any]:
        m = self.store.manifest
        return {
            "path": self.job.model.path,
            "config_sha256": m.model_config_hash,
            "tokenizer_sha256": m.tokenizer_hash,
            "weights_fingerprint": m.weights_fingerprint,
            "chat_template_sha256": m.chat_template_hash,
            "dtype": self.job.model.dtype,
        }

    # -- one shard ----------------------------------------------------------------------------

    def _process(self, lease: Lease) -> dict[str, Any]:
        if lease.shard >= len(self.store.shards):  # planned after this worker opened the store
            try:
                self.store.refresh()
            except Exception as exc:  # e.g. a failed GET: the shard goes back, the worker stays
                cause = f"cannot read shard {lease.shard}'s plan: {type(exc).__name__}: {exc}"
            else:
                planned = lease.shard < len(self.store.shards)
                cause = None if planned else f"shard {lease.shard} is not in the store's plan"
            if cause is not None:
                ray.get(self.queue.release.remote(lease.lease_id, cause))
                logger.warning("worker %s: %s", self.id, cause)
                return {"shard": lease.shard, "worker": self.id, "left": cause}
        shard = self.store.shards[lease.shard]
        started = time.monotonic()
        self.phase = "working"
        self.progress = {
            "shard": shard.index,
            "written": 0,
            "failed": 0,
            "deferred": lease.deferred,
        }
        planned = planned_samples(self.store, shard, image_urls(self.store))
        attempts: Counter[int] = Counter()
        call = ray_caller(self.queue)
        with LeaseKeeper(call, lease, self.config.heartbeat_s) as keeper:
            try:
                writer = ShardWriter(
                    self.store,
                    shard,
                    self.config.writer_threads,
                    fence=keeper,
                    spill_dir=self.dump_dir / f"spill-{lease.lease_id}" if lease.deferred else None,
                    fence_timeout=lease.claim_timeout,
                )
            except LeaseLost as exc:
                return {**self._summary(lease, started, None), **self._lease_lost(lease, exc)}
            try:
                todo = sorted(planned)
                while todo:
                    todo = self._capture_samples(todo, planned, attempts, writer)
                    if todo:  # the server died with these unwritten
                        self._restart_server()
                        self.phase = "working"
                summary = writer.commit(self._summary(lease, started, writer))
            except LeaseLost as exc:
                writer.abort()
                return {**self._summary(lease, started, writer), **self._lease_lost(lease, exc)}
            except BaseException as exc:
                writer.abort()
                ray.get(self.queue.release.remote(lease.lease_id, f"{type(exc).__name__}: {exc}"))
                raise
        if not ray.get(self.queue.complete.remote(lease.lease_id, summary)):
            return {**summary, **self._lease_lost(lease, "the queue refused the completion")}
        self.metrics.record_shard(summary)
        return summary

    def _lease_lost(self, lease: Lease, cause: object) -> dict[str, Any]:
        """Summary fields of a shard left because its lease was lost, and why (also logged)."""
        logger.warning("worker %s: shard %d left, lease lost: %s", self.id, lease.shard, cause)
        return {"lease_lost": True, "lease_lost_cause": str(cause)}

    def _capture_samples(
        self,
        todo: list[int],
        planned: dict[int, PlannedSample],
        attempts: Counter[int],
        writer: ShardWriter,
    ) -> list[int]:
        """Keep K requests in flight over `todo` until each sample is written or failed; returns
        the samples left unwritten because the server died (empty otherwise).

        Two stages, so the server never waits on our post-processing: a request's slot is
        refilled as soon as its response arrives, while its dump is read and verified on
        another thread. Rows reach the writer from this thread only. Dumps held at once: at
        most K being read plus K more awaiting their reader."""
        queue, left = list(todo), []
        sending: dict[Future[CaptureResponse], int] = {}
        reading: dict[Future[Captured], int] = {}
        requesters = ThreadPoolExecutor(self.config.inflight, thread_name_prefix="request")
        readers = ThreadPoolExecutor(self.config.inflight, thread_name_prefix="read")
        try:
            while queue or sending or reading:
                while queue and len(sending) < self.config.inflight:
                    i = queue.pop(0)
                    attempts[i] += 1
                    sending[requesters.submit(self._request, i, planned[i], attempts[i])] = i
                done, _ = wait([*sending, *reading], return_when=FIRST_COMPLETED)
                for future in done:
                    i = sending.pop(future) if future in sending else reading.pop(future)
                    try:
                        result = future.result()
                    except (DumpMismatch, CaptureError, requests.RequestException) as exc:
                        if isinstance(exc, requests.RequestException) and not self._server_ok():
                            attempts[i] -= 1  # the server's death is not the sample's fault
                            left.append(i)
                        elif attempts[i] < self.config.sample_attempts:
                            queue.append(i)
                        else:
                            writer.mark_failed(i, f"after {attempts[i]} attempts: {exc}")
                            self.progress["failed"] += 1
                            self.metrics.failed.inc()
                        continue
                    if isinstance(result, CaptureResponse):
                        reading[readers.submit(self._read_verified, result, planned[i])] = i
                    else:
                        self._write(i, result, writer)
                if left:  # the server is gone: what is queued waits for its restart
                    left += queue
                    queue = []
        except BaseException:  # e.g. the lease lost: nothing more is sent, nothing kept
            for pool in (requesters, readers):
                pool.shutdown(wait=True, cancel_futures=True)
            _release_unconsumed([*sending, *reading])
            raise
        finally:
            requesters.shutdown()
            readers.shutdown()
        return left

    def _server_ok(self) -> bool:
        return self.server is not None and self.server.alive() and self.server.healthy()

    def _request(self, i: int, sample: PlannedSample, attempt: int) -> CaptureResponse:
        """Prefill sample i (a request thread); its dump is published meanwhile."""
        assert self.server is not None
        rid = f"{RID_PREFIX}s{i}-a{attempt}-{uuid.uuid4().hex[:8]}"
        t0 = time.perf_counter()
        response = generate_and_capture(
            self.server, rid, **sample.request(), timeout=self.job.server.request_timeout_s
        )
        self.metrics.record_request(len(sample.input_ids), time.perf_counter() - t0)
        return response

    def _read_verified(self, response: CaptureResponse, sample: PlannedSample) -> Captured:
        """Read a dump and check it against its planned sample (a reader thread)."""
        assert self.calibration is not None
        t0 = time.perf_counter()
        try:
            tensors, meta = read_dump(wait_for_dump(response.dump_path))
            check_dump(
                tensors,
                meta,
                rid=response.rid,
                sample=sample,
                cached_tokens=int(response.meta_info.get("cached_tokens", 0)),
                manifest=self.store.manifest,
                calibration=self.calibration,
            )
        except BaseException:
            release_dump(response.dump_path)
            raise
        self.metrics.record_verify(time.perf_counter() - t0)
        names, quantized = self.store.manifest.hidden_arrays, meta.get("quantized")
        if quantized:
            states = tuple(Fp8Rows(tensors[n], tensors[scale_name(n)]) for n in names)
        else:
            states = tuple(tensors[n] for n in names)
        return Captured(states, response.dump_path)

    def _write(self, i: int, captured: Captured, writer: ShardWriter) -> None:
        t0 = time.perf_counter()
        release = functools.partial(release_dump, captured.dump_path)
        try:
            # The rows may still be read after this returns: the writer gives the dump back
            # (to the server's pinned ring) once it is done with them.
            writer.write_sample(i, *captured.states, on_release=release)
        except BaseException:
            release()
            raise
        self.metrics.record_write(time.perf_counter() - t0, sum(x.nbytes for x in captured.states))
        self.progress["written"] += 1

    def _summary(self, lease: Lease, started: float, writer: ShardWriter | None) -> dict[str, Any]:
        seconds = time.monotonic() - started
        shard = self.store.shards[lease.shard]
        tokens = shard.token_end - shard.token_begin
        return {
            "shard": shard.index,
            "worker": self.id,
            "samples": shard.sample_end - shard.sample_begin,
            "written": self.progress["written"],
            "failed": self.progress["failed"],
            "tokens": tokens,
            "seconds": round(seconds, 3),
            "tokens_per_s": round(tokens / seconds, 1) if seconds else None,
            "bytes_written": writer.bytes_written if writer else 0,
            "deferred": lease.deferred,
            "server_restarts": self.restarts,
            "fp8_quantized_by": self._fp8_quantized_by(),
            "finished_at": round(time.time(), 3),  # wall clock: comparable across nodes
        }


def _release_unconsumed(futures: list[Future[Any]]) -> None:
    """Release the dumps of responses never read and of captures never written (a shard left
    early): every dump a finished request produced, once it is published."""
    for future in futures:
        if future.cancelled() or future.exception() is not None:
            continue  # no dump, or its reader released it (_read_verified)
        path = future.result().dump_path
        with contextlib.suppress(CaptureError):  # never published: nothing to release
            release_dump(wait_for_dump(path, timeout=30))


def dump_root(config: WorkerConfig) -> Path:
    return Path(config.dump_root)


def log_root(config: WorkerConfig) -> Path:
    return Path(config.log_root or tempfile.gettempdir())


def reclaim_node(config: WorkerConfig) -> list[Path]:
    """Remove what dead workers left on this node: their dump folders and the SGLang segments no
    process holds, at once; their logs once `log_retention_s` old. The folders removed."""
    removed = reclaim_abandoned(dump_root(config), DUMPS_PREFIX)
    reclaim_orphan_segments()
    return removed + reclaim_abandoned(log_root(config), LOGS_PREFIX, keep_s=config.log_retention_s)


@ray.remote(num_cpus=0)
def reclaim_after(
    config: WorkerConfig, worker_ids: list[str], timeout_s: float = 60.0
) -> tuple[int, list[str]]:
    """The node-level sweep the driver runs at a job's end (cluster/driver.py
    `_reclaim_nodes`). Where `worker_ids` ended without their cleanup (stopped with ray.kill,
    killed, failed): once they are gone (ray.kill returns before the process dies), what they
    left goes, a server segment made just before its server was killed too (once old enough
    to judge). With none (a resumed job's other nodes) one pass: what an earlier
    submission's workers left. The number of folders removed, and the dump folders of
    `worker_ids` still there after `timeout_s` (their holders live on)."""
    if not worker_ids:  # every worker here cleaned up after itself: one pass, for the others
        return len(reclaim_node(config)), []
    deadline, removed = time.monotonic() + timeout_s, 0
    while True:
        removed += len(reclaim_node(config))
        left = [
            folder.name
            for worker_id in worker_ids
            for folder in dump_root(config).glob(f"{DUMPS_PREFIX}{worker_id}-*")
        ]
        if not (left or young_orphan_segments()) or time.monotonic() > deadline:
            return removed, left
        time.sleep(0.5)
