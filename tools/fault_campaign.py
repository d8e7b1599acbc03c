"""The fault campaign: jobs on a local multi-node Ray cluster, their stores on S3, each run through
a seeded schedule of faults, then checked for exactly-once, correct rows and a clean machine.

    .venv/bin/python -m tools.fault_campaign --seed 7            # the full form
    .venv/bin/python -m tools.fault_campaign --short --seed 7    # CI's (times: docs/testing.md)
    .venv/bin/python -m tools.fault_campaign --short --jobs greedy   # one of the form's jobs
    make campaign SEED=7 [CAMPAIGN=--short]

Setup: simulated GPU nodes (ray.cluster_utils.Cluster, each advertising `sglang_node`), a tiny
Llama (the bad_rows job's: a tiny Qwen2.5-VL) served in float32 by one patched SGLang server per
node, the stores on a real S3 server on loopback (moto) reached through a proxy that can fail,
stall or hold requests (and reads them), and the servers' dumps in a small tmpfs of their own that
can be filled (as root; elsewhere /dev/shm, and that fault is skipped). The driver is
`python -m cluster run`, as `ray job submit` starts it. The jobs, one after another: `capture`
(rows captured as they are), then two `generate:` jobs, `greedy` (every assistant turn written
anew) and `sampled` (the last one, temperature 0.8), two responses a prompt, their stores in a
versioned bucket; last `bad_rows`, on a tiny Qwen2.5-VL, so that image sources are read: good rows
(text, chat, images) with every kind of row the planner rejects among them
(tools/campaign_bad_rows.py: lone surrogates, JSON too deep or with a 4300-digit integer, tools
SGLang refuses, images that must not be read, one of them from a loopback server dripping a byte at
a time).

Faults, at seeded moments after a job starts (each of the job's kinds at least once): SIGKILL
of a worker, of a server and of the driver (then the job is submitted again and resumes),
SIGSTOP of a server for a while (a straggler), a node removed and another added, the S3
endpoint resetting or stalling every connection for a while, the dump file system full for a
while; in the generate jobs also a worker SIGKILLed mid-claim (while its upload of a part's
responses is held; the upload lands after it died); the bad_rows job's, lighter: a worker's
and the driver's SIGKILL (the full form adds a server's and S3 resetting). A driver that
exits short of a complete store is submitted again too.

Checked at the end of each job: every planned sample committed exactly once, in input order, with
its own tokens; `verify`'s integrity checks pass; one seeded sample per shard equals an independent
float32 recompute (HF transformers); the report's counts match the store; nothing of ours is left
in /dev/shm, the dump root, the workers' log folder or the temp dir, and no process of a server
lives on. Of the generate jobs (tools/campaign_generation.py): every prompt's samples planned once,
each part's responses written once (one object version), no kept part generated again, each sample
its stored responses; the greedy job's responses the reference's greedy decode. Of the bad_rows
job: each bad row rejected once, in the store and the report alike, with a reason matching its
row's pattern, and no good row; every sample with images recomputed too (HF's Qwen2.5-VL, its
stored images); the job done within 360 s, or its driver is killed and that is a problem (something
hung). The seed fixes the schedules and the samples checked; what each fault hits depends on the
job's progress at that moment, which it does not.
The last line: `CAMPAIGN seed=... faults=... resubmits=... lost=0 duplicated=0 rewritten=0
regenerated=0 leftovers=0 PASS`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from tools.campaign_bad_rows import (
    Expected,
    check_image_sample,
    check_rejects,
    dripping_server,
    write_input,
)
from tools.campaign_cluster import (
    NODE_ARGS,
    configure_local_ray,
    dump_file_system,
    our_processes,
    our_shm_files,
    our_temp_entries,
    ray_cluster,
)
from tools.campaign_generation import RESPONSES_PUT, check_generated, stored_versions
from tools.fault_injection import FaultyProxy, processes, server_groups, socket_owner
from tools.s3_server import s3_server
from tools.tiny_models import ensure_models

MODEL = "llama-tiny"
VL_MODEL = "qwen25-vl-tiny"  # the bad_rows job's: its image rows are read, not refused unread
DTYPE = "float32"  # served and stored exactly enough for a plain recompute to judge
LAYERS = {MODEL: [0, 2, 4], VL_MODEL: [0, 1, 2]}  # Qwen-style ids: HF hidden_states 1..3
MAX_SUBMISSIONS = 40
GENERATED_BUCKET = "campaign-generated"  # versioned: each landed PUT is a version
LEFTOVER_SETTLE_S = 20.0  # how long leftovers may take to go after a job, before they count

KINDS = (
    "kill_worker",
    "kill_server",
    "freeze_server",
    "kill_driver",
    "replace_node",
    "s3_reset",
    "s3_stall",
    "disk_full",
)
# A generate job's short list: the faults that meet generation (a worker killed while it
# generates, or while it writes a part's responses; the driver; S3 failing under the writes).
GENERATION_KINDS = ("kill_worker", "claim_kill", "kill_driver", "s3_reset", "s3_stall")
LASTING = {"freeze_server": (4, 10), "s3_reset": (3, 8), "s3_stall": (3, 8), "disk_full": (4, 10)}
# How long a killed claimant's upload stays held after its death: the driver gives its part
# back meanwhile, so the next holder may begin generating it before the upload lands. Below
# the S3 client's 2 s timeout, so uploads of other workers held meanwhile are not retried.
CLAIM_HOLD_S = 1.5

# The bad_rows job's: its faults meet the good rows' capture; that the bad ones stay rejected
# through a resumed plan is the driver's kill's.
BAD_ROWS_KINDS = ("kill_worker", "kill_driver")
# Its bound, beyond which it hung: 98-120 s measured (2 cores, short form), the rest a loaded
# machine's margin.
BAD_ROWS_WITHIN_S = 360.0

GREEDY = {"turns": "all", "n": 2, "max_new_tokens": 16, "temperature": 0.0}
SAMPLED = {"turns": "last", "n": 2, "max_new_tokens": 16, "temperature": 0.8, "top_p": 0.95}


def holders(path: str) -> str:
    """Which processes hold `path` open (a folder's lock is an open descriptor): what tells a
    leftover whose holder lives from one no sweep reached."""
    found = []
    for fd in Path("/proc").glob("[0-9]*/fd/*"):
        with contextlib.suppress(OSError):
            if os.readlink(fd) == path:
                pid = fd.parts[2]
                command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
                found.append(f"pid {pid}: {command.decode(errors='replace')[:120].strip()}")
    return "held by " + "; ".join(found) if found else "held by no process"


# A worker's id in its folders' names (actors/node_worker.py): host, node, slot, incarnation.
WORKER_ID = re.compile(r"hsx-(?:dumps|worker)-(\S+?-s\d+-w\d+)-")


def said_of_leftovers(leftovers: set[str], driver_log: Path) -> list[str]:
    """What the driver said of the workers whose folders were left (every submission's lines
    naming them): the story a leftover's age and holders alone do not tell."""
    workers = sorted({m.group(1) for entry in leftovers if (m := WORKER_ID.search(entry))})
    if not workers or not driver_log.exists():
        return []
    lines = driver_log.read_text(errors="replace").splitlines()
    return [
        f"the driver of {worker}: {line.strip()[:300]}"
        for worker in workers
        for line in lines
        if worker in line
    ]


def describe(leftover: str) -> str:
    """A leftover as a problem line: a file's holders, age and (a folder's) first entries, what
    tells when and by what it was made; a process as it is."""
    path = Path(leftover)
    if leftover.startswith("process ") or not path.exists():
        return leftover
    age = time.time() - path.stat().st_mtime
    line = f"{leftover} ({holders(leftover)}; changed {age:.0f} s ago"
    if path.is_dir():
        entries = sorted(str(p.relative_to(path)) for p in path.rglob("*"))
        line += f"; holds {entries[:6]}{' ...' if len(entries) > 6 else ''}"
    return line + ")"


@dataclass(frozen=True)
class JobPlan:
    name: str
    samples: int  # input rows (a generate job's: prompts)
    samples_per_shard: int
    faults: int
    # Faults fall in [15 s, window_s) after the job's first submission; a generate job's also
    # wait for its generation to get that far (`Fault.after_parts`).
    window_s: float
    kinds: tuple[str, ...] = KINDS
    generate: dict[str, Any] | None = None
    model: str = MODEL
    # The input mixes every kind of bad row among `samples` good ones
    # (tools/campaign_bad_rows.py); each must be rejected with its reason.
    bad_rows: bool = False
    # The job must be done (its last driver exited 0) this long after its first submission:
    # none of its rows hung it. None: no bound.
    within_s: float | None = None

    def time_left(self, started: float) -> float | None:
        if self.within_s is None:
            return None
        return max(0.0, started + self.within_s - time.monotonic())

    @property
    def parts(self) -> int:
        """A generate job's parts of prompts (cluster/generation_feed.py cuts them so)."""
        assert self.generate is not None
        per_part = max(1, self.samples_per_shard // self.generate["n"])
        return -(-self.samples // per_part)


@dataclass(frozen=True)
class Form:
    nodes: int
    jobs: tuple[JobPlan, ...]


FORMS = {
    "short": Form(
        nodes=2,
        jobs=(
            JobPlan("capture", 1200, 40, faults=8, window_s=150),
            JobPlan("greedy", 48, 16, 5, 60, GENERATION_KINDS, GREEDY),
            JobPlan("sampled", 48, 16, 5, 60, GENERATION_KINDS, SAMPLED),
            JobPlan(
                "bad_rows",
                24,
                7,
                2,
                45,
                BAD_ROWS_KINDS,
                model=VL_MODEL,
                bad_rows=True,
                within_s=BAD_ROWS_WITHIN_S,
            ),
        ),
    ),
    "full": Form(
        nodes=3,
        jobs=(
            JobPlan("capture", 6000, 50, faults=24, window_s=540),
            JobPlan("greedy", 240, 16, 12, 150, (*KINDS, "claim_kill"), GREEDY),
            JobPlan("sampled", 240, 16, 12, 150, (*KINDS, "claim_kill"), SAMPLED),
            JobPlan(
                "bad_rows",
                96,
                8,
                4,
                90,
                (*BAD_ROWS_KINDS, "kill_server", "s3_reset"),
                model=VL_MODEL,
                bad_rows=True,
                within_s=2 * BAD_ROWS_WITHIN_S,
            ),
        ),
    ),
}


@dataclass(frozen=True)
class Fault:
    at_s: float
    kind: str
    lasts_s: float = 0.0
    pick: int = 0  # which of the processes or nodes it can hit (modulo their number)
    # A generate job's: not before this many parts' responses were uploaded, so that the
    # faults meet generation however fast the machine generates.
    after_parts: int = 0

    def __str__(self) -> str:
        lasting = f" for {self.lasts_s:.0f} s" if self.lasts_s else ""
        parts = f", {self.after_parts} parts uploaded" if self.after_parts else ""
        return f"t={self.at_s:6.1f} s{parts}  {self.kind}{lasting}"


def make_schedule(seed: int, job: JobPlan) -> list[Fault]:
    """`job.faults` faults, every one of its kinds at least once, at seeded moments at least
    8 s apart; a generate job's spread over its generation too (the j-th of F after j/(F+1)
    of its parts)."""
    rng = random.Random(f"{seed}/{job.name}")
    kinds = list(job.kinds) + [rng.choice(job.kinds) for _ in range(job.faults - len(job.kinds))]
    rng.shuffle(kinds)
    gap = (job.window_s - 15) / len(kinds)
    faults = []
    for j, kind in enumerate(kinds):
        at = 15 + j * gap + rng.uniform(0, max(gap - 8, 0))
        low, high = LASTING.get(kind, (0, 0))
        after = (j + 1) * job.parts // (len(kinds) + 1) if job.generate else 0
        lasts, pick = rng.uniform(low, high), rng.randrange(1 << 16)
        faults.append(Fault(round(at, 1), kind, lasts, pick, after))
    return faults


@dataclass
class Outcome:
    injected: list[str] = field(default_factory=list)
    missed: list[str] = field(default_factory=list)
    submissions: int = 0
    problems: list[str] = field(default_factory=list)
    lost: int = 0
    duplicated: int = 0
    rewritten: int = 0  # responses objects written more than once
    regenerated: int = 0  # kept parts generated again
    leftovers: list[str] = field(default_factory=list)


@dataclass
class Job:
    """One job of the campaign as it runs: its plan, folder, input rows and store."""

    plan: JobPlan
    work: Path
    url: str
    rows: list[dict[str, Any]] = field(default_factory=list)  # the good ones, in input order
    schedule: list[Fault] = field(default_factory=list)
    bad: list[Expected] = field(default_factory=list)  # the bad rows, each rejected as expected
    hung: bool = False  # not done within its plan's `within_s` (its driver killed)


class Campaign:
    def __init__(
        self,
        seed: int,
        form: Form,
        work: Path,
        say: Callable[[str], None],
        jobs: list[JobPlan] | None = None,
    ) -> None:
        self.seed, self.form, self.work, self.say = seed, form, work, say
        self.jobs = jobs if jobs is not None else list(form.jobs)
        self.outcome = Outcome()
        names = sorted({plan.model for plan in self.jobs})
        self.models = ensure_models(Path(".cache/models").resolve(), names)
        self.model = self.models[self.jobs[0].model]  # the running job's (run_one sets it)
        self.drip_url = ""  # the bad_rows job's image source that never finishes
        self.driver: subprocess.Popen[bytes] | None = None
        self._lock = threading.Lock()  # the driver handle: the fault thread kills it

    # -- the setup ------------------------------------------------------------------------------

    def run(self) -> Outcome:
        with contextlib.ExitStack() as stack:
            self.s3 = stack.enter_context(s3_server("campaign"))
            self.s3.client().create_bucket(Bucket=GENERATED_BUCKET)
            self.s3.client().put_bucket_versioning(
                Bucket=GENERATED_BUCKET, VersioningConfiguration={"Status": "Enabled"}
            )
            # The bodies of responses uploads are kept: what the regeneration check reads.
            self.proxy = stack.enter_context(FaultyProxy(self.s3.endpoint, rb"/responses-"))
            self.dump_root = stack.enter_context(dump_file_system(self.work / "dumps"))
            self.cluster = stack.enter_context(ray_cluster(self.form.nodes))
            if any(plan.bad_rows for plan in self.jobs):
                self.drip_url = stack.enter_context(dripping_server())
            if not self.dump_root.filler:
                self.say("(disk_full is skipped: mounting a tmpfs needs root)")
            for plan in self.jobs:
                self.run_one(plan)
        return self.outcome

    def run_one(self, plan: JobPlan) -> None:
        bucket = self.s3.bucket if plan.generate is None else GENERATED_BUCKET
        job = Job(plan, self.work / plan.name, f"s3://{bucket}/{plan.name}.zarr")
        job.work.mkdir()
        job.schedule = make_schedule(self.seed, plan)
        self.model = self.models[plan.model]
        shm_before, temp_before = our_shm_files(), our_temp_entries()
        config = self.write_config(job)
        what = "generate, then capture" if plan.generate else "capture"
        bad = f" and {len(job.bad)} bad ones" if job.bad else ""
        self.say(
            f"== job {plan.name} ({what}): {len(job.rows)} rows{bad}, {plan.model}, "
            f"{self.form.nodes} nodes, store {job.url}"
        )
        if plan.generate:
            self.say(f"   generate: {json.dumps(plan.generate)}")
        self.say("schedule:\n" + "\n".join(f"  {f}" for f in job.schedule))
        started = time.monotonic()
        self.run_job(job, config)
        self.wait_servers_gone()
        if not job.hung:  # a hung job's store may not even be made: its problem says enough
            self.check_store(job)

        def left() -> set[str]:
            return (
                (our_shm_files() - shm_before)
                | {str(p) for p in self.dump_root.path.iterdir()}
                | {str(p) for p in (job.work / "logs").glob("*")}
                | (our_temp_entries() - temp_before)
                | our_processes(self.dump_root.path)
            )

        # What is still there once the node has settled: the end-of-job sweep removes an unheld
        # segment only once it is 5 s old (actors/process_group.py), a resource tracker its
        # semaphores once its clients are gone.
        deadline = time.monotonic() + LEFTOVER_SETTLE_S
        while (found := left()) and time.monotonic() < deadline:
            time.sleep(1.0)
        self.outcome.leftovers += [describe(entry) for entry in sorted(found)]
        self.outcome.problems += said_of_leftovers(found, job.work / "driver.log")
        self.say(f"== job {plan.name}: {time.monotonic() - started:.0f} s")

    def write_config(self, job: Job) -> Path:
        from tests.helpers.prompts import write_prompts

        prompts, data = job.work / "prompts.jsonl", {}
        if job.plan.bad_rows:
            data = self.write_mixed(job, prompts)
        else:
            job.rows = write_prompts(prompts, job.plan.samples)
        options = {
            **self.s3.options,
            "endpoint": self.proxy.endpoint,
            # Short, so a stalled endpoint costs seconds: bound 2 + 4 + 1 s, margin 22 s.
            "client_options": {"timeout": "2s", "connect_timeout": "1s"},
            "retry_config": {
                "max_retries": 8,
                "retry_timeout": "4s",
                "backoff": {"init_backoff": "100ms", "max_backoff": "1s", "base": 2},
            },
        }
        config: dict[str, Any] = {
            "model": {
                "path": str(self.model),
                "dtype": DTYPE,
                "aux_layer_ids": LAYERS[job.plan.model],
            },
            "data": {"paths": [str(prompts)], "max_length": 2048, **data},
            "store": {
                "url": job.url,
                "storage_options": options,
                "samples_per_shard": job.plan.samples_per_shard,
                "chunk_tokens": 256,
            },
            "queue": {"lease_s": 60, "shard_attempts": 50, "straggler_min_s": 15},
            "server": {"restarts": 50, "request_timeout_s": 60, "start_timeout_s": 300},
            "worker": {
                "dump_root": str(self.dump_root.path),
                "log_root": str(job.work / "logs"),
                "log_retention_s": 0,
                "max_node_failures": 50,
                "inflight": 4,
                "heartbeat_s": 5,
            },
            "driver": {"progress_interval_s": 5, "log_interval_s": 10, "finish_grace_s": 10},
        }
        if job.plan.generate is not None:
            config["generate"] = job.plan.generate
        path = job.work / "job.yaml"
        path.write_text(yaml.safe_dump(config))
        path.chmod(0o600)  # it holds the S3 secret
        return path

    def write_mixed(self, job: Job, prompts: Path) -> dict[str, Any]:
        """The bad_rows job's input (its good rows to `job.rows`, its bad ones to `job.bad`);
        the `data:` options its rows are meant for."""
        from cluster.images import vision_settings
        from tests.helpers.prompts import good_rows

        images = vision_settings(self.model)[0] is not None
        # A template without tool support rejects an agent's row (tiny Qwen2.5-VL's does).
        good = [r for r in good_rows(job.plan.samples) if not images or "tools" not in r]
        outside = self.work / f"{job.plan.name}-outside.png"  # beside the job's folder
        mixed = write_input(prompts, good, outside, self.drip_url, images)
        job.rows, job.bad = mixed.good, mixed.bad
        return mixed.data

    # -- the job and its faults -----------------------------------------------------------------

    def run_job(self, job: Job, config: Path) -> None:
        """Submit the job, again after each exit short of a complete store, while the faults
        come from this thread (Ray's cluster_utils removes a node only from the main thread)."""
        started, done = time.monotonic(), threading.Event()
        ended: list[BaseException | None] = []

        def submit() -> None:
            try:
                self.submit_until_done(job, config, started)
                ended.append(None)
            except BaseException as exc:
                ended.append(exc)
            finally:
                done.set()

        threading.Thread(target=submit, name="submitter", daemon=True).start()
        self.inject_all(job, started, done)
        done.wait()
        if ended[0] is not None:
            raise ended[0]

    def submit_until_done(self, job: Job, config: Path, started: float) -> None:
        from tests.helpers.jobs import start_driver  # Ray's modules: after configure_local_ray

        log, submissions = job.work / "driver.log", 0
        while True:
            with self._lock:
                self.driver = start_driver(config, self.cluster.address, log)
                submissions += 1
                self.outcome.submissions += 1
            try:
                code = self.driver.wait(timeout=job.plan.time_left(started))
            except subprocess.TimeoutExpired:
                self.give_up(job)
                return
            elapsed = time.monotonic() - started
            self.say(f"[{elapsed:6.1f} s] driver exited {code} (submission {submissions})")
            if code == 0:
                return
            if code == 2:
                raise RuntimeError(f"the job was refused: see {log}")
            if submissions >= MAX_SUBMISSIONS:
                raise RuntimeError(f"the job did not complete in {MAX_SUBMISSIONS} submissions")

    def give_up(self, job: Job) -> None:
        """A job past its `within_s`: something of it hung. Its driver is killed (its workers
        and servers end with it), and its store is judged as it is."""
        with self._lock:
            assert self.driver is not None
            self.driver.kill()
            self.driver.wait()
        job.hung = True
        self.outcome.problems.append(
            f"[{job.plan.name}] not done within {job.plan.within_s:.0f} s: its driver was killed"
        )

    def inject_all(self, job: Job, started: float, stop: threading.Event) -> None:
        schedule, previous_end = job.schedule, started
        for j, fault in enumerate(schedule):
            # A generate job's faults wait for its progress: still 8 s after the one before.
            at = max(started + fault.at_s, previous_end + 8 if fault.after_parts else 0)
            due = stop.wait(max(0.0, at - time.monotonic()))
            while not due and self.parts_uploaded(job) < fault.after_parts:
                due = stop.wait(0.5)
            if due:  # the stop event: the job ended
                self.outcome.missed += [f"{f.kind}: the job ended first" for f in schedule[j:]]
                return
            try:
                what = self.inject(fault, stop)
            except Exception as exc:  # a fault that could not be injected is reported
                what = None
                self.say(f"  fault {fault}: {type(exc).__name__}: {exc}")
            previous_end = time.monotonic()
            line = f"[{previous_end - started:6.1f} s] {fault.kind}: {what or 'no target'}"
            self.say(line)
            (self.outcome.injected if what else self.outcome.missed).append(line)

    def inject(self, fault: Fault, stop: threading.Event) -> str | None:
        kind, pick = fault.kind, fault.pick
        if kind == "kill_worker":
            pids = wait_for(lambda: processes(b"ray::NodeWorker"), stop)
            if pids:
                os.kill(pids[pick % len(pids)], signal.SIGKILL)
                return f"SIGKILL worker pid {pids[pick % len(pids)]}"
        elif kind == "claim_kill":
            return self.kill_mid_claim(stop)
        elif kind in ("kill_server", "freeze_server"):
            groups = wait_for(lambda: server_groups(self.model), stop)
            if not groups:
                return None
            group = groups[pick % len(groups)]
            if kind == "kill_server":
                os.kill(group, signal.SIGKILL)  # its leader; the worker sees it die
                return f"SIGKILL server pid {group}"
            os.killpg(group, signal.SIGSTOP)
            stop.wait(fault.lasts_s)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(group, signal.SIGCONT)
            return f"SIGSTOP server group {group} for {fault.lasts_s:.0f} s"
        elif kind == "kill_driver":
            with self._lock:
                if self.driver is None or self.driver.poll() is not None:
                    return None
                self.driver.send_signal(signal.SIGKILL)
                return f"SIGKILL driver pid {self.driver.pid} (then submitted again)"
        elif kind == "replace_node":
            nodes = list(self.cluster.worker_nodes)
            gone = nodes[pick % len(nodes)]
            self.cluster.remove_node(gone, allow_graceful=False)
            self.cluster.add_node(**NODE_ARGS)
            return "removed a node (its worker and server with it) and added another"
        elif kind in ("s3_reset", "s3_stall"):
            self.proxy.mode = "reset" if kind == "s3_reset" else "stall"
            stop.wait(fault.lasts_s)
            self.proxy.mode = "pass"
            how = "resetting" if kind == "s3_reset" else "stalling"
            return f"S3 endpoint {how} every connection for {fault.lasts_s:.0f} s"
        elif kind == "disk_full":
            if not self.dump_root.filler:
                return None
            taken = self.dump_root.filler.fill()
            stop.wait(fault.lasts_s)
            self.dump_root.filler.release()
            return f"dump file system full ({taken >> 20} MiB taken) for {fault.lasts_s:.0f} s"
        return None

    def parts_uploaded(self, job: Job) -> int:
        """The parts of `job` whose responses the proxy has seen uploaded (landed or not)."""
        mark = f"/{job.plan.name}.zarr/generation/responses-"
        return len({r.target for r in list(self.proxy.requests) if mark in r.target and r.body})

    def kill_mid_claim(self, stop: threading.Event) -> str | None:
        """The next upload of a part's responses is held (its worker has won the part's claim
        and is writing), its worker SIGKILLed, and the upload let through CLAIM_HOLD_S later."""
        self.proxy.held.clear()
        self.proxy.hold = RESPONSES_PUT
        try:
            if not wait_for(lambda: list(self.proxy.held), stop, timeout=120):
                return None
            pid = socket_owner(self.proxy.held[0], processes(b"ray::NodeWorker"))
            if pid is None:
                return None
            os.kill(pid, signal.SIGKILL)
            stop.wait(CLAIM_HOLD_S)
            return f"SIGKILL worker pid {pid} mid-claim (its responses upload landed after)"
        finally:
            self.proxy.hold = None

    # -- the checks -----------------------------------------------------------------------------

    def wait_servers_gone(self, timeout: float = 60.0) -> None:
        """Servers of killed workers end by SIGTERM from the kernel (pdeathsig): a few seconds."""
        deadline = time.monotonic() + timeout
        while server_groups(self.model) and time.monotonic() < deadline:
            time.sleep(0.5)
        if left := server_groups(self.model):
            self.outcome.problems.append(f"servers still running after the job: {left}")

    def check_store(self, job: Job) -> None:
        from cluster.verify import verify
        from hsx_store.format import Store

        options = {**self.s3.options}  # straight to the server, not through the proxy
        store = Store.open(job.url, storage_options=options)
        g, problems = store.group, []
        ids = [str(x) for x in g["sample_id"][:]]
        if job.plan.generate is None and ids != [r["id"] for r in job.rows]:
            problems.append("the store's sample ids are not the input's, in order")
        status = np.asarray(g["sample_status"][:])
        committed = store.committed()
        summaries = [store.summary(k) for k in np.flatnonzero(committed).tolist()]
        written = sum(s["written"] for s in summaries)
        self.outcome.lost += int((status != 1).sum()) + sum(
            sh.sample_end - sh.sample_begin for sh in store.shards if not committed[sh.index]
        )
        self.outcome.duplicated += max(0, written - store.num_samples)
        report = verify(job.url, storage_options=options, say=lambda _: None)
        if not report.ok:
            problems.append("verify: " + report.format())
        self.check_report(store, problems)
        if job.plan.bad_rows:
            report = store.group.attrs.get("report") or {}
            found = check_rejects(store.rejected, report, job.bad)
            problems += found
            self.say(f"the rejects of {len(job.bad)} bad rows checked: {len(found)} problems")
        self.check_rows(store, problems)
        if job.plan.generate is not None:
            self.check_generation(job, store, problems)
        self.outcome.problems += [f"[{job.plan.name}] {p}" for p in problems]

    def check_generation(self, job: Job, store: Any, problems: list[str]) -> None:
        gen, name = job.plan.generate, job.plan.name
        assert gen is not None
        versions = stored_versions(self.s3.client(), GENERATED_BUCKET, f"{name}.zarr/generation/")
        uploads = [r for r in self.proxy.requests if r.body and f"/{name}.zarr/" in r.target]
        found = check_generated(
            store,
            [r["id"] for r in job.rows],
            gen,
            job.plan.samples_per_shard,
            versions,
            uploads,
            self.model if gen["temperature"] == 0 else None,
        )
        problems += found.problems
        self.outcome.rewritten += found.rewritten
        self.outcome.regenerated += found.regenerated
        self.say(found.summary)
        lost = (job.work / "driver.log").read_text().count("parts of prompts")
        self.say(f"workers lost holding parts of prompts (their generation cut short): {lost}")

    def check_report(self, store: Any, problems: list[str]) -> None:
        report = store.group.attrs.get("report") or {}
        counts = report.get("samples", {})
        expected = {
            "planned": store.num_samples,
            "written": store.num_samples,
            "failed": 0,
            "not_committed": 0,
        }
        got = {k: counts.get(k) for k in expected}
        if got != expected or not report.get("ok"):
            problems.append(f"the report says {got}, the store {expected}")

    def check_rows(self, store: Any, problems: list[str]) -> None:
        """One seeded sample per shard against HF transformers in float32; in a vision
        model's store, also every sample with images (what it runs on the vision model for)."""
        rng = random.Random(self.seed)
        picked = [rng.randrange(sh.sample_begin, sh.sample_end) for sh in store.shards]
        if store.manifest.image_token_id is None:
            for sh, i in zip(store.shards, picked, strict=True):
                self.check_text_sample(store, sh.index, i, problems)
            self.say(f"recomputed one sample of each of the {len(store.shards)} shards")
            return
        imaged = set(store.sample_images(0, store.num_samples))
        for i in sorted(set(picked) | imaged):
            try:
                check_image_sample(self.model, store, i)
            except AssertionError as exc:
                shard = next(sh for sh in store.shards if sh.sample_begin <= i < sh.sample_end)
                problems.append(f"shard {shard.index}: {exc}")
        self.say(
            f"recomputed one sample of each of the {len(store.shards)} shards and the "
            f"{len(imaged)} samples with images"
        )

    def check_text_sample(self, store: Any, shard: int, i: int, problems: list[str]) -> None:
        import torch

        from tests.helpers.hf_reference import TOLERANCE, assert_matches

        rows, g = store.sample_rows(i), store.group
        arrays = ("aux_hidden_states", "final_hidden_states", "prenorm_hidden_states")
        aux, final, prenorm = (torch.from_numpy(np.asarray(g[a][rows])) for a in arrays)
        try:
            assert_matches(
                self.model,
                g["input_ids"][rows].tolist(),
                store.manifest.layer_ids,
                aux,
                final,
                **TOLERANCE[DTYPE],
                what=f"sample {i}",
                prenorm=prenorm,
            )
        except AssertionError as exc:
            problems.append(f"shard {shard}: {exc}")


def wait_for(
    find: Callable[[], list[int]], stop: threading.Event, timeout: float = 60
) -> list[int]:
    """What `find` finds, waiting up to `timeout` for something (e.g. a server restarting)."""
    deadline = time.monotonic() + timeout
    while not (found := find()) and time.monotonic() < deadline and not stop.wait(0.5):
        pass
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tools.fault_campaign",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--short", action="store_true", help="CI's form: 2 nodes, fewer faults")
    parser.add_argument(
        "--jobs", help="which of the form's jobs to run, comma-separated (default: every one)"
    )
    parser.add_argument("--keep", action="store_true", help="keep the work folder (logs)")
    args = parser.parse_args(argv)
    form = FORMS["short" if args.short else "full"]
    jobs = list(form.jobs)
    if args.jobs:
        names = args.jobs.split(",")
        if unknown := [n for n in names if n not in {j.name for j in form.jobs}]:
            parser.error(f"--jobs: no job {unknown} (the form's: {[j.name for j in form.jobs]})")
        jobs = [j for j in form.jobs if j.name in names]
    configure_local_ray()
    work = Path(tempfile.mkdtemp(prefix="campaign-"))
    say = lambda text: print(text, flush=True)  # noqa: E731
    say(
        f"fault campaign, seed {args.seed}, {'short' if args.short else 'full'} form, jobs "
        f"{', '.join(j.name for j in jobs)}; work folder {work}"
    )
    started = time.monotonic()
    try:
        outcome = Campaign(args.seed, form, work, say, jobs).run()
    finally:
        if not args.keep:
            subprocess.run(["rm", "-rf", str(work)], check=False)
    bad = outcome.lost or outcome.duplicated or outcome.rewritten or outcome.regenerated
    ok = not (outcome.problems or bad or outcome.leftovers)
    for line in outcome.problems + [f"left behind: {p}" for p in outcome.leftovers]:
        say(f"PROBLEM {line}")
    say(json.dumps({"missed": outcome.missed}) if outcome.missed else "every fault hit a target")
    say(
        f"CAMPAIGN seed={args.seed} faults={len(outcome.injected)} "
        f"resubmits={outcome.submissions - len(jobs)} lost={outcome.lost} "
        f"duplicated={outcome.duplicated} rewritten={outcome.rewritten} "
        f"regenerated={outcome.regenerated} leftovers={len(outcome.leftovers)} "
        f"minutes={(time.monotonic() - started) / 60:.1f} {'PASS' if ok else 'FAIL'}"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
