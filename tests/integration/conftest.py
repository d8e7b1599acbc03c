"""Integration fixtures: what several modules check on the same real job."""

from __future__ import annotations

import hashlib
import itertools
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import ray
import ray._private.state as ray_state
from ray import JobID

from actors.private_folders import SHM_ROOT
from cluster import plan_sources
from cluster.config import parse_config
from cluster.driver import Driver
from cluster.plan_feed import PlanFeed
from cluster.status import job_status
from hsx_store.format import Store
from hsx_store.reader import HiddenStatesIterable
from tests.helpers.example_trainer import train
from tests.helpers.jobs import FinishedJob, job_config, store_committed
from tests.helpers.prompts import write_prompts
from tests.helpers.ray_cluster import PAIR_NODE, SimulatedCluster


@pytest.fixture(scope="session")
def deepseek_job(
    ray_cluster: SimulatedCluster,
    deepseek_path: Path,
    tmp_path_factory: pytest.TempPathFactory,
    trainers_python: Path,
) -> FinishedJob:
    """One job on the tiny DeepseekV3 (served in float32, layers [0, 1, 3]) by two servers on
    one node: 12 good rows (chat and text) and 5 bad ones, 3 samples a shard, planned in parts
    of a few rows. Planning holds after its first shards until one is committed (so capture
    starts while the rest is planned); the worker that committed it is then killed, and the
    driver replaces it in its slot. The example trainer (examples/train_while_extracting.py)
    is started with the job, waits for its store, trains from the first commit on, is killed
    after its first checkpoint (while planning is held) and started again from it. A follow
    reader in this process records what it yields. Read it only; copy the store to change
    it."""
    root = tmp_path_factory.mktemp("deepseek-job")
    rows = write_prompts(root / "prompts.jsonl", 12, bad=True)
    raw = job_config(deepseek_path, root / "prompts.jsonl", root / "s.zarr", root)
    # What the killed worker leaves on the node goes at once (its log too).
    raw["worker"].update(node_resource=PAIR_NODE, servers_per_node=2, log_retention_s=0)
    ray_cluster.acquire()  # first: the runtime context below would start a Ray of its own
    segments_before = server_segments()
    queues_before = shard_queue_nodes()
    resume_planning, fed = threading.Event(), itertools.count()
    feed = PlanFeed._feed

    def held_feed(self: PlanFeed, shards: list) -> None:
        if next(fed) > 0:
            assert resume_planning.wait(600), "planning was never resumed"
        feed(self, shards)

    log: list[str] = []
    result: list[int] = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(plan_sources, "PART_BYTES", 400)  # parts of a few rows each
        patch.setattr(PlanFeed, "_feed", held_feed)
        driver = Driver(parse_config(raw), say=log.append)
        thread = threading.Thread(target=lambda: result.append(driver.run()))
        thread.start()
        trainer = root / "trainer"
        first_run = train(trainers_python, root / "s.zarr", trainer)  # it waits for the store
        trainers = [first_run]
        followed: list[tuple[str, str]] = []
        try:
            deadline = time.monotonic() + 400
            while store_committed(root / "s.zarr") < 1:
                assert time.monotonic() < deadline and thread.is_alive(), "nothing committed"
                time.sleep(0.2)
            store = Store.open(root / "s.zarr")
            planning_when_captured = not store.planned
            (committed,) = np.flatnonzero(store.committed()).tolist()
            committer = store.summary(committed)["worker"]
            victim = next(r for r in driver.workers.values() if r.worker_id == committer)
            # Killed once the other server is up too: its replacement's start would otherwise
            # slow the other's on these 2 cores, and the job waits for one of them.
            while "starting" in worker_phases(driver):
                assert time.monotonic() < deadline, "the two servers were never up at once"
                time.sleep(0.2)
            ray.kill(victim.handle, no_restart=True)
            reader = HiddenStatesIterable(str(root / "s.zarr"), follow=True, poll_s=0.2)
            following = threading.Thread(target=lambda: followed.extend(digests(reader)))
            following.start()
            while not (trainer / "checkpoint.pt").exists():
                running = first_run.poll() is None and time.monotonic() < deadline
                assert running, (trainer / "log-1.txt").read_text()[-3000:]
                time.sleep(0.1)
            first_run.kill()
            assert first_run.wait(60) == -9
            resumed = train(trainers_python, root / "s.zarr", trainer)
            trainers.append(resumed)
            status_running = job_status(str(root / "s.zarr"))
        except BaseException:
            for process in trainers:  # not left following a job that will not finish
                process.kill()
            raise
        finally:
            resume_planning.set()
            thread.join(600)
    assert result == [0], "\n".join(log)[-6000:]
    assert resumed.wait(120) == 0, (trainer / "log-2.txt").read_text()[-3000:]
    following.join(120)
    ray_cluster.release()
    leftovers = sorted(p.name for p in root.glob("hsx-*"))
    leftovers += sorted(server_segments() - segments_before)
    queues = {a: node for a, node in shard_queue_nodes().items() if a not in queues_before}
    return FinishedJob(
        root / "s.zarr", rows, log, raw, victim.worker_id, victim.slot, planning_when_captured,
        leftovers, trainer, followed, reader.ended, status_running, queues,
    )  # fmt: skip


def shard_queue_nodes() -> dict[str, str]:
    """Every shard queue this process's Ray job made (the actor table keeps dead actors; other
    tests make queues of their own, unpinned): actor id -> the node it ran on."""
    job = JobID.from_hex(ray.get_runtime_context().get_job_id())
    actors = ray_state.actors(job_id=job).values()
    return {
        a["ActorID"]: a["Address"]["NodeID"] for a in actors if a["ActorClassName"] == "ShardQueue"
    }


def worker_phases(driver: Driver) -> list[str]:
    """Each running worker's phase; "starting" for one that does not answer yet (its actor
    still being created)."""
    asked = [w.handle.status.remote() for w in list(driver.workers.values())]
    answered, silent = ray.wait(asked, num_returns=len(asked), timeout=2)
    return [ray.get(ref)["phase"] for ref in answered] + ["starting"] * len(silent)


def digests(reader: HiddenStatesIterable) -> Iterator[tuple[str, str]]:
    """Each sample's id with the sha256 of its final hidden states."""
    for sample in reader:
        data = sample["final_hidden_states"].float().numpy().tobytes()
        yield sample["sample_id"], hashlib.sha256(data).hexdigest()


def server_segments() -> set[str]:
    """What SGLang servers leave in /dev/shm when killed (their load snapshot, semaphores)."""
    return {p.name for p in SHM_ROOT.iterdir() if p.name.startswith(("sglang_loads_", "sem.mp-"))}
