"""The whole job on simulated GPU nodes (ray.cluster_utils.Cluster) with real CPU SGLang
servers on the tiny DeepseekV3, two nodes of a server each or one node of two: exactly-once
output that matches its plan and an independent HF reference, bad rows rejected, a killed
worker, a straggler, a killed driver and a resume; the example trainer (a draft trained with
speculators' code) following the job, killed and resumed."""

from __future__ import annotations

import hashlib
import math
import os
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import ray
import safetensors.torch
import torch
import yaml
import zarr
from ray.cluster_utils import Cluster

from cluster import plan_sources
from cluster.__main__ import main as cli_main
from cluster.config import parse_config
from cluster.driver import Driver, _Running, run_job
from cluster.job_store import manifest_for, open_or_create, plan_into
from cluster.plan import build_plan
from cluster.report import ProgressMeter
from cluster.shard_queue import ShardQueueActor
from cluster.status import job_status
from cluster.verify import verify
from hsx_store.builder import create_store
from hsx_store.format import Store
from hsx_store.reader import COMPLETE, HiddenStatesDataset
from tests.helpers.example_trainer import EXAMPLE
from tests.helpers.jobs import (
    FinishedJob,
    assert_exactly_once,
    assert_store_matches_reference,
    job_config,
    kill_after_commits,
    start_driver,
    store_committed,
)
from tests.helpers.prompts import BAD_LINES, write_prompts
from tests.helpers.ray_cluster import SOLO_NODE
from tests.helpers.reports import assert_status_is_report


def test_a_job_writes_every_sample_once_matching_plan_and_reference_and_rejects_bad_rows(
    deepseek_job: FinishedJob, deepseek_path: Path
) -> None:
    rows, log = deepseek_job.rows, deepseek_job.log
    store = Store.open(deepseek_job.url)
    assert_exactly_once(store, rows, deepseek_path)
    reasons = {r["sample_id"]: r["reason"] for r in store.rejected}
    assert set(reasons) == {*BAD_LINES, "prompts.jsonl:6"}, reasons
    assert "256" in reasons["bad-long"] and "malformed JSON" in reasons["prompts.jsonl:6"]
    assert "int" in reasons["bad-type"] and "content" in reasons["bad-content"]
    # Loss masks: assistant tokens of chat rows only, every token of text rows.
    mask = np.asarray(store.group["loss_mask"][:])
    for i, row in enumerate(rows):
        m = mask[store.sample_rows(i)]
        assert m.all() if "text" in row else (m.any() and not m.all()), row["id"]
    assert_store_matches_reference(store, deepseek_path, list(range(len(store.shards))))
    report = store.group.attrs["report"]
    assert report["ok"] and report["samples"]["written"] == len(rows)
    assert report["samples"]["rejected_at_plan"] == 5
    text = "\n".join(log)
    assert "storage estimate" in text and "hidden-state extraction report" in text
    assert "ETA" in text


def test_capture_starts_while_planning_and_a_killed_worker_is_replaced_in_its_slot(
    deepseek_job: FinishedJob,
) -> None:
    """Two servers on one node; the worker that committed the first shard was killed."""
    store, log = Store.open(deepseek_job.url), deepseek_job.log
    # A shard was committed while the plan was incomplete: seen then, and in the timestamps.
    planning = store.group.attrs["report"]["run"]["planning"]
    first_commit = min(store.summary(k)["finished_at"] for k in range(len(store.shards)))
    assert deepseek_job.captured_while_planning and first_commit < planning["finished_at"]
    lost = store.group.attrs["report"]["run"]["workers_lost"]
    assert [w["worker"] for w in lost] == [deepseek_job.killed]
    # Two slots on the node; the replacement (the third worker) took the victim's.
    node = deepseek_job.killed.rsplit("-s", 1)[0]
    started = sorted(line.removeprefix("started ") for line in log if line.startswith("started"))
    replacement = f"{node}-s{deepseek_job.killed_slot}-w3"
    assert started == sorted([f"{node}-s0-w1", f"{node}-s1-w2", replacement]), started
    writers = {store.summary(k)["worker"] for k in range(len(store.shards))}
    assert {w.split("-s")[-1].split("-w")[0] for w in writers} == {"0", "1"}, writers
    # A replacement still starting once every shard was done is stopped, not waited for.
    stopped = f"{replacement}: stopping it (still starting when every shard was done)"
    assert stopped in log or replacement in writers, log
    # The node ends clean: the killed worker's dumps, log and server segments are gone.
    assert deepseek_job.leftovers == []


def test_the_queue_ran_on_the_drivers_node(deepseek_job: FinishedJob) -> None:
    """Not on a GPU node, whose loss would take the queue, and the driver, with it (the fault
    campaign's replace_node did)."""
    here = ray.get_runtime_context().get_node_id()
    assert deepseek_job.queue_nodes and set(deepseek_job.queue_nodes.values()) == {here}


def test_a_follow_reader_of_the_running_job_yielded_every_stored_sample_once(
    deepseek_job: FinishedJob,
) -> None:
    """A follow reader, started at the first commit, yields the stored rows of every sample
    once, and ends when the job is complete."""
    ids = [sample_id for sample_id, _ in deepseek_job.followed]
    assert sorted(ids) == sorted(r["id"] for r in deepseek_job.rows), "each sample once"
    stored = {
        s["sample_id"]: hashlib.sha256(s["final_hidden_states"].float().numpy().tobytes())
        for s in HiddenStatesDataset(str(deepseek_job.url))
    }
    assert dict(deepseek_job.followed) == {k: v.hexdigest() for k, v in stored.items()}
    assert deepseek_job.follow_ended == COMPLETE


def test_the_example_trainer_killed_and_resumed_trained_on_every_sample_once_while_the_job_ran(
    deepseek_job: FinishedJob,
) -> None:
    """examples/train_while_extracting.py (speculators' EAGLE-3 draft, on CPU), a step per
    sample: started before the store existed, SIGKILLed after its first checkpoint (planning
    held, so the job had more to write), started again from it, it ends with the job."""
    out = deepseek_job.trainer
    progress = torch.load(out / "checkpoint.pt", weights_only=True)["progress"]
    assert sorted(progress["trained"]) == sorted(r["id"] for r in deepseek_job.rows)
    steps = [line["step"] for line in progress["history"]]
    assert steps == list(range(1, len(deepseek_job.rows) + 1))
    assert all(math.isfinite(line["loss"]) for line in progress["history"])
    first, resumed = (out / "log-1.txt").read_text(), (out / "log-2.txt").read_text()
    assert "step 1:" in first and "resumed from step" not in first
    saved_at = int(resumed.split("resumed from step ")[1].split()[0])
    assert 1 <= saved_at < len(steps) and f"step {saved_at + 1}:" in resumed
    assert f"following ended: {COMPLETE}" in resumed
    # It trained while the job wrote: its first step came before the last shard committed.
    store = Store.open(deepseek_job.url)
    last_commit = max(store.summary(k)["finished_at"] for k in range(len(store.shards)))
    assert progress["history"][0]["time"] < last_commit
    draft = safetensors.torch.load_file(out / "draft" / "model.safetensors")
    assert draft and all(torch.isfinite(t).all() for t in draft.values())


def test_the_example_trainer_refuses_a_checkpoint_of_another_store(
    deepseek_job: FinishedJob, trainers_python: Path, tmp_path: Path
) -> None:
    """The same job's store made again (a new store_id): the saved cursor would skip its
    shards, so the checkpoint is refused and nothing is trained."""
    store, out = tmp_path / "s.zarr", tmp_path / "trainer"
    shutil.copytree(deepseek_job.url, store)
    zarr.open_group(store, mode="r+").attrs["store_id"] = "0" * 32
    shutil.copytree(deepseek_job.trainer, out)
    before = (out / "checkpoint.pt").read_bytes()
    command = [trainers_python, EXAMPLE, "--store", store, "--out", out]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1 and "was trained from another store" in done.stderr
    assert (out / "checkpoint.pt").read_bytes() == before


def test_status_said_while_the_job_ran_and_after_it_what_the_store_and_report_say(
    deepseek_job: FinishedJob, capsys: pytest.CaptureFixture
) -> None:
    running = deepseek_job.status_running
    assert running["state"] == "running" and running["planning"] == "in progress"
    committed = running["shards"]["committed"]
    assert committed >= 1 and running["samples"]["written"] == 3 * committed  # 3 a shard
    assert running["tokens_per_s"]["since_start"] > 0 and running["eta_s"] is None  # planning
    report = Store.open(deepseek_job.url).group.attrs["report"]
    assert_status_is_report(job_status(str(deepseek_job.url)), report)
    assert cli_main(["status", "--store", str(deepseek_job.url)]) == 0
    assert "complete (planning done)" in capsys.readouterr().out


def test_planning_on_two_nodes_gives_the_store_planning_in_one_process_gives(
    ray_nodes: Cluster, deepseek_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_prompts(tmp_path / "prompts.jsonl", 40, bad=True)
    monkeypatch.setattr(plan_sources, "PART_BYTES", 300)  # ~15 parts, on both nodes' CPUs
    raw = job_config(deepseek_path, tmp_path / "prompts.jsonl", tmp_path / "s.zarr", tmp_path)
    config = parse_config(raw)
    _, _, builder = open_or_create(config, say=lambda _: None)
    fed: list[int] = []
    said: list[str] = []
    plan_into(builder, config, 3, lambda shards: fed.extend(sh.index for sh in shards), said.append)

    plan = build_plan(config.data, deepseek_path)  # in this process, in one go
    # The storage estimate: projected early from the first parts, then exact.
    projected, final = [line for line in said if line.startswith("plan")]
    assert projected.startswith("plan, projected from its first 8 of ") and "GB" in projected
    assert final.startswith(f"plan: {len(plan.sample_ids)} samples, {plan.total_tokens:,} tokens")
    projected_samples = int(projected.split("parts: ")[1].split()[0])
    # Parts of 300 bytes hold 0-3 lines, the bad ones early: a rough projection, yet a sane one.
    assert 0.25 * len(plan.sample_ids) < projected_samples < 4 * len(plan.sample_ids)
    manifest = manifest_for(config, plan.chat_template)
    ref = create_store(
        tmp_path / "ref.zarr",
        manifest,
        plan.sample_ids,
        plan.input_ids,
        plan.loss_masks,
        rejected=plan.rejected,
    )
    assert fed == list(range(len(ref.shards)))  # every shard handed out once, in order
    streamed = Store.open(tmp_path / "s.zarr")
    assert streamed.planned and streamed.rejected == ref.rejected != []
    for name in ("input_ids", "loss_mask", "sample_start", "sample_length", "sample_id"):
        got, want = streamed.group[name], ref.group[name]
        assert got.shape == want.shape and got.dtype == want.dtype, name
        assert np.asarray(got[:]).tobytes() == np.asarray(want[:]).tobytes(), name


def test_a_straggling_shard_is_run_again_at_the_tail_and_only_the_first_commit_is_visible(
    ray_nodes: Cluster, deepseek_path: Path, tmp_path: Path
) -> None:
    rows = write_prompts(tmp_path / "prompts.jsonl", 36)
    raw = job_config(deepseek_path, tmp_path / "prompts.jsonl", tmp_path / "s.zarr", tmp_path)
    raw["store"]["samples_per_shard"] = 12  # 3 shards, each taking seconds at inflight 1
    raw["worker"]["inflight"] = 1
    raw["queue"].update(straggler_factor=1.0, straggler_min_s=2)
    driver = Driver(parse_config(raw), say=lambda _: None)
    result: list[int] = []
    thread = threading.Thread(target=lambda: result.append(driver.run()))
    thread.start()
    # Freeze one worker's server in the middle of a shard: its worker keeps renewing the
    # lease, so only the tail re-issue can get that shard done.
    deadline, frozen = time.monotonic() + 400, None
    while frozen is None:
        assert time.monotonic() < deadline and thread.is_alive(), "no worker got a shard"
        for running in list(driver.workers.values()):
            status = ray.get(running.handle.status.remote())
            if status["shard"] is not None and 1 <= status["written"] <= 6:
                frozen = (running, status["shard"], ray.get(running.handle.server_pid.remote()))
                os.killpg(frozen[2], signal.SIGSTOP)
                break
        time.sleep(0.05)
    running, shard, server_pid = frozen
    try:
        while store_committed(tmp_path / "s.zarr") < 3:
            assert time.monotonic() < deadline and thread.is_alive(), "the straggler stayed"
            time.sleep(0.2)
    finally:
        os.killpg(server_pid, signal.SIGCONT)
    thread.join(600)

    assert result == [0]
    store = Store.open(tmp_path / "s.zarr")
    assert_exactly_once(store, rows, deepseek_path)
    summary = store.summary(shard)
    assert summary["deferred"] and summary["worker"] != running.worker_id
    assert_store_matches_reference(store, deepseek_path, [shard])
    assert list(tmp_path.glob("hsx-dumps-*")) == []  # the straggler's too, stopped or not


def set_immutable(path: Path, on: bool) -> None:
    """`chattr -R +i`: unwritable even by root, unlike a chmod (the tests may run as root)."""
    subprocess.run(["chattr", "-R", "+i" if on else "-i", str(path)], check=True)


def test_a_killed_driver_resumes_then_fails_cleanly_on_a_read_only_store_then_finishes(
    ray_nodes: Cluster, deepseek_path: Path, tmp_path: Path
) -> None:
    """One job's life: `python -m cluster run` (as `ray job submit` starts it) SIGKILLed after a
    commit; submitted again, its store made read-only after another commit, so its shards fail
    cleanly and it says so; submitted once more, writable, it finishes. No committed shard is
    ever redone, and every sample is there exactly once."""
    probe = tmp_path / "probe"
    probe.mkdir()
    try:
        set_immutable(probe, True)
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"chattr +i is not available here: {exc}")
    set_immutable(probe, False)
    rows = write_prompts(tmp_path / "prompts.jsonl", 24)
    url = tmp_path / "s.zarr"
    raw = job_config(deepseek_path, tmp_path / "prompts.jsonl", url, tmp_path)
    raw["worker"].update(node_resource=SOLO_NODE, max_node_failures=1)  # one failure stops it
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(raw))
    first = start_driver(tmp_path / "job.yaml", ray_nodes.address, tmp_path / "driver.log")
    killed = kill_after_commits(first, url, 1)
    assert 1 <= len(killed) < len(Store.open(url).shards)

    log: list[str] = []
    driver = Driver(parse_config(raw), say=log.append)
    result: list[int] = []
    thread = threading.Thread(target=lambda: result.append(driver.run()))
    thread.start()
    deadline = time.monotonic() + 400
    while store_committed(url) <= len(killed):
        assert time.monotonic() < deadline and thread.is_alive(), "no shard was committed"
        time.sleep(0.2)
    set_immutable(url, True)
    try:
        thread.join(600)
        assert result == [1]
        text = "\n".join(log)
        assert "Operation not permitted" in text and str(url) in text, text[-3000:]
        assert "hidden-state extraction report" in text
        assert f"could not keep the report in the store: {url}: PermissionError" in text
        # Nothing half-committed: every committed shard is whole and right, the rest are
        # named as not committed, and no other check fails.
        store = Store.open(url)
        committed = np.flatnonzero(store.committed()).tolist()
        assert len(killed) < len(committed) < len(store.shards)
        report = verify(url)
        assert {f.check for f in report.findings if f.level == "error"} == {"commits"}
        assert_store_matches_reference(store, deepseek_path, committed)
        before = {k: store.summary(k) for k in committed}
    finally:
        set_immutable(url, False)

    # Writable again: the same job resumes and finishes, every sample exactly once.
    assert run_job(parse_config(raw), say=lambda _: None) == 0
    store = Store.open(url)
    assert_exactly_once(store, rows, deepseek_path)
    assert {k: store.summary(k) for k in before} == before, "committed shards were redone"
    run = store.group.attrs["report"]["run"]
    assert run["resumed"] and run["shards_committed"] == len(store.shards) - len(before)
    assert list(tmp_path.glob("hsx-dumps-*")) == []  # the killed driver's workers' too


@ray.remote(num_cpus=0)
class JustCommitted:
    """A worker whose shard commits between the driver's two reads: asked for its state, it
    completes its shard at the queue first, then reports itself idle."""

    def __init__(self, queue: Any) -> None:
        self.queue = queue

    def status(self) -> dict[str, Any]:
        lease = ray.get(self.queue.acquire.remote("w"))
        ray.get(self.queue.claim.remote(lease.lease_id))
        summary = {"samples": 3, "tokens": 30, "bytes_written": 0, "failed": {}}
        assert ray.get(self.queue.complete.remote(lease.lease_id, summary))
        return {"worker": "w", "phase": "idle", "shard": None, "written": 0}


def test_the_progress_line_counts_a_shard_committed_between_its_reads(
    ray_nodes: Cluster, deepseek_path: Path, tmp_path: Path
) -> None:
    raw = job_config(deepseek_path, tmp_path / "prompts.jsonl", tmp_path / "s.zarr", tmp_path)
    driver = Driver(parse_config(raw))
    queue = ShardQueueActor.remote([0, 1])
    worker = JustCommitted.remote(queue)
    driver.workers[ray.put(None)] = _Running("node", "w", worker)
    meter = ProgressMeter(total_samples=6, total_tokens=60)

    assert "samples 3/6" in driver._progress(meter, queue)[0]
