"""The fault campaign: a job on a local multi-node Ray cluster, its store on S3, run through a
seeded schedule of faults, then checked for exactly-once, correct rows and a clean machine.

    .venv/bin/python -m tools.fault_campaign --seed 7            # the full form (~17 min, 2 cores)
    .venv/bin/python -m tools.fault_campaign --short --seed 7    # CI's (~5 minutes)
    make campaign SEED=7 [CAMPAIGN=--short]

Setup: simulated GPU nodes (ray.cluster_utils.Cluster, each advertising `sglang_node`), a tiny
Llama served in float32 by one patched SGLang server per node, the store on a real S3 server on
loopback (moto) reached through a proxy that can fail or stall requests, and the servers' dumps
in a small tmpfs of their own that can be filled (as root; elsewhere /dev/shm, and that fault is
skipped). The driver is `python -m cluster run`, as `ray job submit` starts it.

Faults, at seeded moments after the job starts (each kind at least once): SIGKILL of a worker, of
a server and of the driver (then the job is submitted again and resumes), SIGSTOP of a server
for a while (a straggler), a node removed and another added, the S3 endpoint resetting or
stalling every connection for a while, the dump file system full for a while. A driver that
exits short of a complete store is submitted again too.

Checked at the end: every planned sample committed exactly once, in input order, with its own
tokens; `verify`'s integrity checks pass; one seeded sample per shard equals an independent
float32 recompute (HF transformers); the report's counts match the store; nothing of ours is
left in /dev/shm, the dump root, the workers' log folder or the temp dir. The seed fixes the
schedule and the samples checked; what each fault hits depends on the job's progress at that
moment, which it does not.
The last line: `CAMPAIGN seed=... faults=... resubmits=... lost=0 duplicated=0 leftovers=0 PASS`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from actors.private_folders import SHM_ROOT
from tools.fault_injection import DiskFiller, FaultyProxy, processes, server_groups
from tools.ray_head import private_temp_dir
from tools.s3_server import S3Server, s3_server
from tools.tiny_models import ensure_models

MODEL = "llama-tiny"
DTYPE = "float32"  # served and stored exactly enough for a plain recompute to judge
LAYERS = [0, 2, 4]
DUMP_FS_BYTES = 256 << 20
MAX_SUBMISSIONS = 40

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
LASTING = {"freeze_server": (4, 10), "s3_reset": (3, 8), "s3_stall": (3, 8), "disk_full": (4, 10)}


@dataclass(frozen=True)
class Form:
    nodes: int
    samples: int
    samples_per_shard: int
    faults: int
    window_s: float  # faults fall in [15 s, window_s) after the job's first submission


FORMS = {
    "short": Form(nodes=2, samples=1600, samples_per_shard=40, faults=8, window_s=150),
    "full": Form(nodes=3, samples=6000, samples_per_shard=50, faults=24, window_s=540),
}


@dataclass(frozen=True)
class Fault:
    at_s: float
    kind: str
    lasts_s: float = 0.0
    pick: int = 0  # which of the processes or nodes it can hit (modulo their number)

    def __str__(self) -> str:
        lasting = f" for {self.lasts_s:.0f} s" if self.lasts_s else ""
        return f"t={self.at_s:6.1f} s  {self.kind}{lasting}"


def make_schedule(seed: int, form: Form) -> list[Fault]:
    """`form.faults` faults, every kind at least once, at seeded moments at least 8 s apart."""
    rng = random.Random(seed)
    kinds = list(KINDS) + [rng.choice(KINDS) for _ in range(form.faults - len(KINDS))]
    rng.shuffle(kinds)
    gap = (form.window_s - 15) / len(kinds)
    faults = []
    for j, kind in enumerate(kinds):
        at = 15 + j * gap + rng.uniform(0, max(gap - 8, 0))
        low, high = LASTING.get(kind, (0, 0))
        faults.append(Fault(round(at, 1), kind, rng.uniform(low, high), rng.randrange(1 << 16)))
    return faults


@dataclass
class Outcome:
    injected: list[str] = field(default_factory=list)
    missed: list[str] = field(default_factory=list)
    submissions: int = 0
    problems: list[str] = field(default_factory=list)
    lost: int = 0
    duplicated: int = 0
    leftovers: list[str] = field(default_factory=list)


class Campaign:
    def __init__(self, seed: int, form: Form, work: Path, say: Callable[[str], None]) -> None:
        self.seed, self.form, self.work, self.say = seed, form, work, say
        self.schedule = make_schedule(seed, form)
        self.outcome = Outcome()
        self.model = ensure_models(Path(".cache/models").resolve(), [MODEL])[MODEL]
        self.driver: subprocess.Popen[bytes] | None = None
        self._lock = threading.Lock()  # the driver handle: the fault thread kills it

    # -- the setup ------------------------------------------------------------------------------

    def run(self) -> Outcome:
        with contextlib.ExitStack() as stack:
            s3 = stack.enter_context(s3_server("campaign"))
            self.proxy = stack.enter_context(FaultyProxy(s3.endpoint))
            self.dump_root = stack.enter_context(dump_file_system(self.work / "dumps"))
            self.cluster = stack.enter_context(ray_cluster(self.form.nodes))
            shm_before = our_shm_files()
            temp_before = our_temp_entries()
            config = self.write_config(s3)
            self.say(
                f"job: {self.form.samples} samples, {self.shards} shards of {MODEL}, "
                f"{self.form.nodes} nodes, store {self.url}"
            )
            self.say("schedule:\n" + "\n".join(f"  {f}" for f in self.schedule))
            if not self.dump_root.filler:
                self.say("  (disk_full is skipped: mounting a tmpfs needs root)")
            self.run_job(config)
            self.wait_servers_gone()
            self.check_store(s3)
            self.outcome.leftovers = sorted(
                (our_shm_files() - shm_before)
                | {str(p) for p in self.dump_root.path.iterdir()}
                | {str(p) for p in (self.work / "logs").glob("*")}
                | (our_temp_entries() - temp_before)
            )
        return self.outcome

    @property
    def shards(self) -> int:
        return -(-self.form.samples // self.form.samples_per_shard)

    def write_config(self, s3: S3Server) -> Path:
        from tests.helpers.prompts import write_prompts

        self.rows = write_prompts(self.work / "prompts.jsonl", self.form.samples)
        self.url = s3.url("campaign.zarr")
        self.options = {
            **s3.options,
            "endpoint": self.proxy.endpoint,
            # Short, so a stalled endpoint costs seconds: bound 2 + 4 + 1 s, margin 22 s.
            "client_options": {"timeout": "2s", "connect_timeout": "1s"},
            "retry_config": {
                "max_retries": 8,
                "retry_timeout": "4s",
                "backoff": {"init_backoff": "100ms", "max_backoff": "1s", "base": 2},
            },
        }
        config = {
            "model": {"path": str(self.model), "dtype": DTYPE, "aux_layer_ids": LAYERS},
            "data": {"paths": [str(self.work / "prompts.jsonl")]},
            "store": {
                "url": self.url,
                "storage_options": self.options,
                "samples_per_shard": self.form.samples_per_shard,
                "chunk_tokens": 256,
            },
            "queue": {"lease_s": 60, "shard_attempts": 50, "straggler_min_s": 15},
            "server": {"restarts": 50, "request_timeout_s": 60, "start_timeout_s": 300},
            "worker": {
                "dump_root": str(self.dump_root.path),
                "log_root": str(self.work / "logs"),
                "log_retention_s": 0,
                "max_node_failures": 50,
                "inflight": 4,
                "heartbeat_s": 5,
            },
            "driver": {"progress_interval_s": 5, "log_interval_s": 10, "finish_grace_s": 10},
        }
        path = self.work / "job.yaml"
        path.write_text(yaml.safe_dump(config))
        path.chmod(0o600)  # it holds the S3 secret
        return path

    # -- the job and its faults -----------------------------------------------------------------

    def run_job(self, config: Path) -> None:
        """Submit the job, again after each exit short of a complete store, while the faults
        come from this thread (Ray's cluster_utils removes a node only from the main thread)."""
        started, done = time.monotonic(), threading.Event()
        ended: list[BaseException | None] = []

        def submit() -> None:
            try:
                self.submit_until_done(config, started)
                ended.append(None)
            except BaseException as exc:
                ended.append(exc)
            finally:
                done.set()

        threading.Thread(target=submit, name="submitter", daemon=True).start()
        self.inject_all(started, done)
        done.wait()
        if ended[0] is not None:
            raise ended[0]

    def submit_until_done(self, config: Path, started: float) -> None:
        from tests.helpers.jobs import start_driver  # Ray's modules: after configure_local_ray

        while True:
            with self._lock:
                self.driver = start_driver(config, self.cluster.address, self.work / "driver.log")
                self.outcome.submissions += 1
            code = self.driver.wait()
            elapsed = time.monotonic() - started
            self.say(
                f"[{elapsed:6.1f} s] driver exited {code} (submission {self.outcome.submissions})"
            )
            if code == 0:
                return
            if code == 2:
                raise RuntimeError(f"the job was refused: see {self.work / 'driver.log'}")
            if self.outcome.submissions >= MAX_SUBMISSIONS:
                raise RuntimeError(f"the job did not complete in {MAX_SUBMISSIONS} submissions")

    def inject_all(self, started: float, stop: threading.Event) -> None:
        for j, fault in enumerate(self.schedule):
            if stop.wait(max(0.0, started + fault.at_s - time.monotonic())):
                self.outcome.missed += [f"{f.kind}: the job ended first" for f in self.schedule[j:]]
                return
            try:
                what = self.inject(fault, stop)
            except Exception as exc:  # a fault that could not be injected is reported
                what = None
                self.say(f"  fault {fault}: {type(exc).__name__}: {exc}")
            line = f"[{time.monotonic() - started:6.1f} s] {fault.kind}: {what or 'no target'}"
            self.say(line)
            (self.outcome.injected if what else self.outcome.missed).append(line)

    def inject(self, fault: Fault, stop: threading.Event) -> str | None:
        kind, pick = fault.kind, fault.pick
        if kind == "kill_worker":
            pids = wait_for(lambda: processes(b"ray::NodeWorker"), stop)
            if pids:
                os.kill(pids[pick % len(pids)], signal.SIGKILL)
                return f"SIGKILL worker pid {pids[pick % len(pids)]}"
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

    # -- the checks -----------------------------------------------------------------------------

    def wait_servers_gone(self, timeout: float = 60.0) -> None:
        """Servers of killed workers end by SIGTERM from the kernel (pdeathsig): a few seconds."""
        deadline = time.monotonic() + timeout
        while server_groups(self.model) and time.monotonic() < deadline:
            time.sleep(0.5)
        if left := server_groups(self.model):
            self.outcome.problems.append(f"servers still running after the job: {left}")

    def check_store(self, s3: S3Server) -> None:
        from cluster.verify import verify
        from hsx_store.format import Store

        options = {**s3.options}  # straight to the server, not through the proxy
        store = Store.open(self.url, storage_options=options)
        g, problems = store.group, self.outcome.problems
        ids = [str(x) for x in g["sample_id"][:]]
        if ids != [r["id"] for r in self.rows]:
            problems.append("the store's sample ids are not the input's, in order")
        status = np.asarray(g["sample_status"][:])
        committed = store.committed()
        summaries = [store.summary(k) for k in np.flatnonzero(committed).tolist()]
        written = sum(s["written"] for s in summaries)
        self.outcome.lost = int((status != 1).sum()) + sum(
            sh.sample_end - sh.sample_begin for sh in store.shards if not committed[sh.index]
        )
        self.outcome.duplicated = max(0, written - store.num_samples)
        report = verify(self.url, storage_options=options, say=lambda _: None)
        if not report.ok:
            problems.append("verify: " + report.format())
        self.check_report(store)
        self.check_rows(store)

    def check_report(self, store: Any) -> None:
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
            self.outcome.problems.append(f"the report says {got}, the store {expected}")

    def check_rows(self, store: Any) -> None:
        """One seeded sample per shard against HF transformers in float32."""
        import torch

        from tests.helpers.hf_reference import TOLERANCE, assert_matches

        rng, g = random.Random(self.seed), store.group
        for sh in store.shards:
            i = rng.randrange(sh.sample_begin, sh.sample_end)
            rows = store.sample_rows(i)
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
                self.outcome.problems.append(f"shard {sh.index}: {exc}")
        self.say(f"recomputed one sample of each of the {len(store.shards)} shards")


# Every node on loopback, without a dashboard of its own.
ON_LOOPBACK: dict[str, Any] = {"node_ip_address": "127.0.0.1", "include_dashboard": False}
NODE_ARGS: dict[str, Any] = {"num_cpus": 1, "resources": {"sglang_node": 1}, **ON_LOOPBACK}


@dataclass
class DumpRoot:
    path: Path
    filler: DiskFiller | None


@contextlib.contextmanager
def dump_file_system(path: Path) -> Iterator[DumpRoot]:
    """A small tmpfs of the campaign's own for the servers' dumps (as root), so filling it
    touches nobody else; elsewhere a folder in /dev/shm, and no disk_full."""
    path.mkdir(mode=0o700, parents=True)
    mounted = (
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={DUMP_FS_BYTES},mode=0700", "tmpfs", str(path)],
            capture_output=True,
        ).returncode
        == 0
    )
    if mounted:
        try:
            yield DumpRoot(path, DiskFiller(path))
        finally:
            subprocess.run(["umount", "-l", str(path)], check=False)
        return
    shm = Path(tempfile.mkdtemp(prefix="hsx-campaign-", dir=SHM_ROOT))
    try:
        yield DumpRoot(shm, None)
    finally:
        subprocess.run(["rm", "-rf", str(shm)], check=False)


class _Cluster:
    """ray.cluster_utils.Cluster, authenticated (a token of its own), in a temp dir of its own."""

    def __init__(self, nodes: int, temp_dir: str) -> None:
        from ray.cluster_utils import Cluster

        self.temp_dir = temp_dir
        self.inner = Cluster()
        self.inner.add_node(num_cpus=1, temp_dir=temp_dir, **ON_LOOPBACK)  # planning, the driver
        for _ in range(nodes):
            self.inner.add_node(**NODE_ARGS, temp_dir=temp_dir)

    @property
    def address(self) -> str:
        return self.inner.address

    @property
    def worker_nodes(self) -> list[Any]:
        return list(self.inner.worker_nodes)

    def remove_node(self, node: Any, allow_graceful: bool) -> None:
        self.inner.remove_node(node, allow_graceful=allow_graceful)

    def add_node(self, **kwargs: Any) -> None:
        kwargs["temp_dir"] = self.temp_dir
        self.inner.add_node(**kwargs)


def configure_local_ray() -> None:
    """Before anything in this process configures Ray (it reads these once): the cluster
    authenticated (a token of its own), and on loopback (Ray turns a 127.0.0.1 address into the
    machine's own address unless told the cluster is this machine alone; its name for that,
    kept for laptops, is this variable). The driver and every node inherit both."""
    os.environ.update(
        RAY_AUTH_MODE="token",
        RAY_AUTH_TOKEN=secrets.token_hex(32),
        RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0",
    )


@contextlib.contextmanager
def ray_cluster(nodes: int) -> Iterator[_Cluster]:
    with private_temp_dir() as temp_dir:
        cluster = _Cluster(nodes, temp_dir)
        try:
            yield cluster
        finally:
            cluster.inner.shutdown()


def wait_for(
    find: Callable[[], list[int]], stop: threading.Event, timeout: float = 60
) -> list[int]:
    """What `find` finds, waiting up to `timeout` for something (e.g. a server restarting)."""
    deadline = time.monotonic() + timeout
    while not (found := find()) and time.monotonic() < deadline and not stop.wait(0.5):
        pass
    return found


def our_shm_files() -> set[str]:
    marks = ("hsx-", "sglang_loads_", "sem.mp-")
    return {str(p) for p in SHM_ROOT.iterdir() if p.name.startswith(marks)}


def our_temp_entries() -> set[str]:
    return {str(p) for p in Path(tempfile.gettempdir()).glob("hsx-*")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tools.fault_campaign",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--short", action="store_true", help="CI's form: 2 nodes, 8 faults")
    parser.add_argument("--keep", action="store_true", help="keep the work folder (logs)")
    args = parser.parse_args(argv)
    configure_local_ray()
    form = FORMS["short" if args.short else "full"]
    work = Path(tempfile.mkdtemp(prefix="campaign-"))
    say = lambda text: print(text, flush=True)  # noqa: E731
    say(
        f"fault campaign, seed {args.seed}, {'short' if args.short else 'full'} form; "
        f"work folder {work}"
    )
    started = time.monotonic()
    try:
        outcome = Campaign(args.seed, form, work, say).run()
    finally:
        if not args.keep:
            subprocess.run(["rm", "-rf", str(work)], check=False)
    ok = not (outcome.problems or outcome.lost or outcome.duplicated or outcome.leftovers)
    for line in outcome.problems + [f"left behind: {p}" for p in outcome.leftovers]:
        say(f"PROBLEM {line}")
    say(json.dumps({"missed": outcome.missed}) if outcome.missed else "every fault hit a target")
    say(
        f"CAMPAIGN seed={args.seed} faults={len(outcome.injected)} "
        f"resubmits={outcome.submissions - 1} lost={outcome.lost} "
        f"duplicated={outcome.duplicated} leftovers={len(outcome.leftovers)} "
        f"minutes={(time.monotonic() - started) / 60:.1f} {'PASS' if ok else 'FAIL'}"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
