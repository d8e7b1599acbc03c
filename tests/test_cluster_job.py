"""The whole job on two simulated GPU nodes (ray.cluster_utils.Cluster), each with a real CPU
SGLang server on the tiny DeepseekV3, or on one node running two servers: exactly-once output
that matches its plan and an independent HF reference, bad rows rejected, a killed worker, a
killed driver and a resume."""

from __future__ import annotations

import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import ray
import yaml
from ray._common.utils import get_ray_address_file
from ray.cluster_utils import Cluster
from transformers import AutoTokenizer

from cluster import plan_sources
from cluster.__main__ import main as cli_main
from cluster.config import JobConfig, parse_config
from cluster.driver import Driver, _Running, run_job
from cluster.job_store import ResumeConflict, manifest_for, open_or_create, plan_into
from cluster.plan import build_plan
from cluster.report import ProgressMeter
from cluster.shard_queue import ShardQueueActor
from cluster.verify import verify
from hsx_store.export import FORMATS, export
from hsx_store.format import Store, create_store
from hsx_store.reader import HiddenStatesDataset
from tests.test_model_identity import fine_tuned_copy
from tests.test_node_worker import assert_store_matches_reference
from tools.ray_head import private_temp_dir
from tools.s3_server import S3Server

pytestmark = pytest.mark.slow

WORDS = "a draft model learns what the target model would say next at every token".split()


# The head advertises it: a job with `worker.node_resource: PAIR_NODE` runs its servers there.
PAIR_NODE = "pair_node"


@pytest.fixture(scope="module")
def two_nodes() -> Iterator[Cluster]:
    # Cluster writes the head's address to Ray's default temp dir whatever temp_dir says
    # (ray._common.utils.get_ray_address_file), and fails where that directory was never made:
    # on a machine that never ran Ray, /tmp/ray.
    Path(get_ray_address_file(None)).parent.mkdir(parents=True, exist_ok=True)
    with private_temp_dir() as temp_dir:
        cluster = Cluster()
        try:  # a node that fails to start must not leave the others running (ports held)
            cluster.add_node(num_cpus=1, temp_dir=temp_dir, resources={PAIR_NODE: 1})  # the head
            for _ in range(2):
                cluster.add_node(num_cpus=1, resources={"sglang_node": 1}, temp_dir=temp_dir)
            ray.init(address=cluster.address, log_to_driver=False)
            yield cluster
        finally:
            ray.shutdown()
            cluster.shutdown()


def good_rows(count: int) -> list[dict[str, Any]]:
    """Chat rows (some with two assistant turns) and plain text rows of varied lengths."""
    rows = []
    for i in range(count):
        text = " ".join(WORDS[(i * 5 + k) % len(WORDS)] for k in range(3 + (i * 7) % 30))
        if i % 3 == 2:
            rows.append({"id": f"text-{i}", "text": f"{text} #{i}."})
            continue
        messages = [
            {"role": "user", "content": f"{text} #{i}?"},
            {"role": "assistant", "content": " ".join(WORDS[: 2 + i % 8])},
        ]
        if i % 3 == 1:
            messages += [
                {"role": "user", "content": "and then?"},
                {"role": "assistant", "content": "it keeps going."},
            ]
        rows.append({"id": f"chat-{i}", "messages": messages})
    return rows


BAD_LINES = {
    "bad-empty": json.dumps({"id": "bad-empty", "text": ""}),
    "bad-long": json.dumps({"id": "bad-long", "text": "word " * 400}),
    "bad-type": json.dumps({"id": "bad-type", "text": 5}),
    "bad-content": json.dumps({"id": "bad-content", "messages": [{"role": "user", "content": 3}]}),
}


def write_prompts(path: Path, count: int, bad: bool = False) -> list[dict[str, Any]]:
    rows = good_rows(count)
    lines = [json.dumps(r) for r in rows]
    if bad:  # spread among the good rows, plus a line that is not JSON at all
        for j, line in enumerate(BAD_LINES.values()):
            lines.insert(2 + 3 * j, line)
        lines.insert(5, '{"id": "truncated", "text": "no end')
    path.write_text("\n".join(lines) + "\n")
    return rows


def job_config(model: Path, data: Path, store: Path, tmp_path: Path) -> dict[str, Any]:
    return {
        "model": {"path": str(model), "dtype": "float32", "aux_layer_ids": [0, 1, 3]},
        "data": {"paths": [str(data)], "max_length": 256},
        "store": {"url": str(store), "samples_per_shard": 3, "chunk_tokens": 64},
        "server": {"max_total_tokens": 8192, "start_timeout_s": 300, "restart_backoff_s": 0.5},
        "worker": {
            "inflight": 4,
            "heartbeat_s": 0.5,
            "dump_root": str(tmp_path),
            "log_root": str(tmp_path),  # a killed worker keeps its server log: here
        },
        "queue": {"lease_s": 30, "straggler_min_s": 600},
        "driver": {"progress_interval_s": 1},
    }


@functools.cache
def tokenizer_of(model: Path) -> Any:
    return AutoTokenizer.from_pretrained(model)


def expected_ids(model: Path, row: dict[str, Any]) -> list[int]:
    """The row's tokens, computed here independently of the plan."""
    tokenizer = tokenizer_of(model)
    if "text" in row:
        return tokenizer(row["text"])["input_ids"]
    return list(
        tokenizer.apply_chat_template(row["messages"], tokenize=True, return_dict=True)["input_ids"]
    )


def assert_exactly_once(store: Store, rows: list[dict[str, Any]], model: Path) -> None:
    """Every row is one sample, in input order, with its own tokens, written and committed."""
    g = store.group
    assert [str(x) for x in g["sample_id"][:]] == [r["id"] for r in rows]
    assert store.committed().all()
    assert (np.asarray(g["sample_status"][:]) == 1).all()
    for i, row in enumerate(rows):
        assert g["input_ids"][store.sample_rows(i)].tolist() == expected_ids(model, row), row["id"]
    summaries = [store.summary(k) for k in range(len(store.shards))]
    assert sum(s["written"] for s in summaries) == len(rows)
    assert all(not s["failed"] for s in summaries)


def slow_template(model: Path, path: Path, seconds: float = 240) -> Path:
    """The model's own template, rendering the same text, but ~`seconds` of CPU (on an idle
    core) on a conversation that opens with "slow": a part that takes long to plan."""
    loops = int(seconds * 1e9 / 60 / 100_000)  # ~60 ns per Jinja loop step, measured here
    path.write_text(
        "{% if messages[0]['content'].startswith('slow') %}{% for i in range(100000) %}"
        f"{{% for j in range({loops}) %}}{{% endfor %}}{{% endfor %}}{{% endif %}}"
        + tokenizer_of(model).chat_template
    )
    return path


def test_two_nodes_write_every_sample_once_matching_plan_and_reference_and_reject_bad_rows(
    two_nodes: Cluster, deepseek_path: Path, tmp_path: Path
) -> None:
    rows = write_prompts(tmp_path / "prompts.jsonl", 12, bad=True)
    raw = job_config(deepseek_path, tmp_path / "prompts.jsonl", tmp_path / "s.zarr", tmp_path)
    log: list[str] = []

    assert run_job(parse_config(raw), say=log.append) == 0

    store = Store.open(tmp_path / "s.zarr")
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
    assert_store_matches_reference(store, deepseek_path, [0, len(store.shards) - 1])
    report = store.group.attrs["report"]
    assert report["ok"] and report["samples"]["written"] == len(rows)
    assert report["samples"]["rejected_at_plan"] == 5
    text = "\n".join(log)
    assert "storage estimate" in text and "hidden-state extraction report" in text
    assert "ETA" in text


def test_planning_on_two_nodes_gives_the_store_planning_in_one_process_gives(
    two_nodes: Cluster, deepseek_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
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


def test_two_servers_on_one_node_and_a_killed_one_is_replaced_in_its_slot_exactly_once(
    two_nodes: Cluster, deepseek_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Also: capture starts on the first planned shards while the rest is still planned."""
    rows = write_prompts(tmp_path / "prompts.jsonl", 30)
    # Last, in a part of its own: a row whose planning outlasts the servers' startup (the kill
    # and the replacement's startup make this job as long anyway).
    slow = {
        "id": "slow",
        "messages": [{"role": "user", "content": "slow?"}, *rows[0]["messages"][1:]],
    }
    with (tmp_path / "prompts.jsonl").open("a") as f:
        f.write(json.dumps(slow) + "\n")
    rows.append(slow)
    monkeypatch.setattr(plan_sources, "PART_BYTES", 400)  # parts of a few rows each
    raw = job_config(deepseek_path, tmp_path / "prompts.jsonl", tmp_path / "s.zarr", tmp_path)
    raw["data"]["chat_template"] = str(slow_template(deepseek_path, tmp_path / "slow.jinja"))
    raw["worker"].update(node_resource=PAIR_NODE, servers_per_node=2)  # one (CPU) node
    log: list[str] = []
    driver = Driver(parse_config(raw), say=log.append)
    result: list[int] = []
    thread = threading.Thread(target=lambda: result.append(driver.run()))
    thread.start()
    deadline = time.monotonic() + 400
    while not (store_committed(tmp_path / "s.zarr") >= 1 and driver.workers):
        assert time.monotonic() < deadline and thread.is_alive(), "no shard was committed"
        time.sleep(0.2)
    planning_when_captured = not Store.open(tmp_path / "s.zarr").planned
    victim = next(iter(driver.workers.values()))
    ray.kill(victim.handle, no_restart=True)
    thread.join(600)

    assert result == [0], "\n".join(log)[-6000:]
    store = Store.open(tmp_path / "s.zarr")
    assert_exactly_once(store, rows, deepseek_path)
    # A shard was committed while the plan was incomplete: seen here, and in the timestamps.
    planning = store.group.attrs["report"]["run"]["planning"]
    first_commit = min(store.summary(k)["finished_at"] for k in range(len(store.shards)))
    assert planning_when_captured and first_commit < planning["finished_at"], (planning, log)
    lost = store.group.attrs["report"]["run"]["workers_lost"]
    assert [w["worker"] for w in lost] == [victim.worker_id]
    # Two slots on the head node; the replacement (the third worker) took the victim's.
    node = victim.worker_id.rsplit("-s", 1)[0]
    started = sorted(line.removeprefix("started ") for line in log if line.startswith("started"))
    assert started == sorted([f"{node}-s0-w1", f"{node}-s1-w2", f"{node}-s{victim.slot}-w3"]), (
        started
    )
    writers = {store.summary(k)["worker"] for k in range(len(store.shards))}
    assert {w.split("-s")[-1].split("-w")[0] for w in writers} == {"0", "1"}, writers
    assert_store_matches_reference(store, deepseek_path, list(range(len(store.shards))))


def store_committed(url: Path | str, storage_options: dict[str, Any] | None = None) -> int:
    try:
        return int(Store.open(url, storage_options=storage_options).committed().sum())
    except Exception:  # not created yet
        return 0


def start_driver(config: Path, ray_address: str, log: Path) -> subprocess.Popen[bytes]:
    """`python -m cluster run` as `ray job submit` starts it, its output kept in `log`."""
    with log.open("wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "cluster", "run", "--config", str(config)],
            env={**os.environ, "RAY_ADDRESS": ray_address},
            stdout=out,
            stderr=subprocess.STDOUT,
        )


def kill_after_commits(
    driver: subprocess.Popen[bytes], url: Path | str, commits: int, **open_args: Any
) -> dict[int, dict[str, Any]]:
    """SIGKILL the driver once `commits` shards are committed; the committed shards' summaries."""
    deadline = time.monotonic() + 400
    while store_committed(url, **open_args) < commits:
        assert time.monotonic() < deadline and driver.poll() is None, "no shard was committed"
        time.sleep(0.2)
    driver.send_signal(signal.SIGKILL)
    driver.wait()
    store = Store.open(url, **open_args)
    return {k: store.summary(k) for k in np.flatnonzero(store.committed()).tolist()}


def test_a_stopped_driver_resumes_skipping_committed_shards_and_refuses_another_job(
    two_nodes: Cluster, deepseek_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    rows = write_prompts(tmp_path / "prompts.jsonl", 30)
    raw = job_config(deepseek_path, tmp_path / "prompts.jsonl", tmp_path / "s.zarr", tmp_path)
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(raw))
    first = start_driver(tmp_path / "job.yaml", two_nodes.address, tmp_path / "driver.log")
    before = kill_after_commits(first, tmp_path / "s.zarr", 2)
    assert 2 <= len(before) < 10

    assert run_job(JobConfig.model_validate(raw), say=lambda _: None) == 0

    store = Store.open(tmp_path / "s.zarr")
    assert_exactly_once(store, rows, deepseek_path)
    assert {k: store.summary(k) for k in before} == before, "committed shards were not redone"
    report = store.group.attrs["report"]
    assert report["run"]["resumed"]
    assert report["run"]["shards_committed"] == len(store.shards) - len(before)

    # The same store with other layers or shard size is another job: refused, fields named.
    status = cli_main(
        [
            "run",
            "--config",
            str(tmp_path / "job.yaml"),
            "--set",
            "model.aux_layer_ids=[0,2]",
            "--set",
            "store.samples_per_shard=5",
        ]
    )
    err = capsys.readouterr().err
    assert status == 2 and "refusing to resume" in err
    assert "layer_ids" in err and "samples_per_shard" in err


def test_a_straggling_shard_is_run_again_at_the_tail_and_only_the_first_commit_is_visible(
    two_nodes: Cluster, deepseek_path: Path, tmp_path: Path
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


class DriverKilled(Exception):
    pass


def test_an_interrupted_plan_is_planned_again_and_an_interrupted_creation_made_anew(
    deepseek_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rows = write_prompts(tmp_path / "prompts.jsonl", 7)
    monkeypatch.setattr(plan_sources, "PART_BYTES", 300)
    url = tmp_path / "s.zarr"
    config = parse_config(job_config(deepseek_path, tmp_path / "prompts.jsonl", url, tmp_path))
    _, _, builder = open_or_create(config, say=lambda _: None)

    def killed(shards: list) -> None:  # the driver dies once the first shards are out
        raise DriverKilled

    with pytest.raises(DriverKilled):
        plan_into(builder, config, 0, killed)
    assert 0 < len(Store.open(url).shards) < 3 and not Store.open(url).planned

    said: list[str] = []
    store, resumed, builder = open_or_create(config, say=said.append)
    assert resumed and builder is not None and "was being planned" in said[0]
    fed: list[int] = []
    plan_into(builder, config, 0, lambda shards: fed.extend(sh.index for sh in shards))
    assert fed and fed[0] == 1 and fed == list(range(fed[0], 3))  # only what was missing
    assert Store.open(url).planned
    for i, row in enumerate(rows):
        assert store.group["input_ids"][store.sample_rows(i)].tolist() == expected_ids(
            deepseek_path, row
        )

    # Killed while making the arrays: no `created` marker, nothing any worker could have used.
    store.group.attrs.put({k: v for k, v in store.group.attrs.items() if k != "created"})
    store, resumed, builder = open_or_create(config, say=said.append)
    assert not resumed and builder is not None and "an earlier creation was interrupted" in said[-2]
    plan_into(builder, config, 0, lambda shards: None)
    assert Store.open(url).num_samples == len(rows)


def test_a_job_on_s3_resumes_after_the_driver_is_killed_and_reads_verifies_and_exports_there(
    two_nodes: Cluster, deepseek_path: Path, tmp_path: Path, s3: S3Server
) -> None:
    rows = write_prompts(tmp_path / "prompts.jsonl", 15)
    url = s3.url(f"{tmp_path.name}/s.zarr")
    raw = job_config(deepseek_path, tmp_path / "prompts.jsonl", url, tmp_path)
    raw["store"]["storage_options"] = s3.options
    raw["queue"]["lease_s"] = 300  # beyond the margin object storage needs (its write bound)
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(raw))
    first = start_driver(tmp_path / "job.yaml", two_nodes.address, tmp_path / "driver.log")
    before = kill_after_commits(first, url, 1, storage_options=s3.options)
    assert 1 <= len(before) < 5
    log = [(tmp_path / "driver.log").read_text()]

    assert run_job(parse_config(raw), say=log.append) == 0

    assert not list(tmp_path.rglob("zarr.json")), "nothing of the store is on local disk"
    store = Store.open(url, storage_options=s3.options)
    assert_exactly_once(store, rows, deepseek_path)
    assert {k: store.summary(k) for k in before} == before, "committed shards were not redone"
    assert store.group.attrs["report"]["run"]["resumed"]
    assert_store_matches_reference(store, deepseek_path, [0, len(store.shards) - 1])
    report = verify(
        url,
        model_path=str(deepseek_path),
        recompute=2,
        dump_root=str(tmp_path),
        storage_options=s3.options,
        say=log.append,
    )
    assert report.ok, report.format()
    assert [r["ok"] for r in report.checked["recomputed"]] == [True, True]
    reader = HiddenStatesDataset(url, storage_options=s3.options)
    for fmt in FORMATS:
        result = export(url, tmp_path / fmt, fmt, storage_options=s3.options, say=log.append)
        assert result["files"] == len(reader) == len(rows)
    assert s3.secret_access_key not in "\n".join(log) + report.format()


def test_a_prompt_file_changed_since_the_store_was_planned_is_refused_naming_it(
    deepseek_path: Path, tmp_path: Path
) -> None:
    prompts = tmp_path / "prompts.jsonl"
    write_prompts(prompts, 5)
    config = parse_config(job_config(deepseek_path, prompts, tmp_path / "s.zarr", tmp_path))
    open_or_create(config, say=lambda _: None)
    prompts.write_text(prompts.read_text().replace("#1", "#one"))  # one sample edited

    with pytest.raises(ResumeConflict, match=f"{prompts}: changed since the store was planned"):
        open_or_create(config, say=lambda _: None)


def test_a_store_is_resumed_only_with_the_checkpoint_that_planned_it(
    deepseek_path: Path, tmp_path: Path
) -> None:
    """The same weights moved elsewhere resume; a fine-tune at the same path (config, tokenizer
    and file sizes unchanged) is refused naming its weights; so is a store of schema 2, which
    recorded no weights to compare."""
    prompts = tmp_path / "prompts.jsonl"
    write_prompts(prompts, 5)
    model = Path(shutil.copytree(deepseek_path, tmp_path / "model"))
    raw = job_config(model, prompts, tmp_path / "s.zarr", tmp_path)
    open_or_create(parse_config(raw), say=lambda _: None)

    moved = model.rename(tmp_path / "moved")
    raw["model"]["path"] = str(moved)
    store, resumed, _ = open_or_create(parse_config(raw), say=lambda _: None)
    assert resumed and store.manifest.model == str(model)

    fine_tuned_copy(moved, model)
    raw["model"]["path"] = str(model)
    with pytest.raises(ResumeConflict, match=r"weights_fingerprint: store '\w+' != config '\w+'"):
        open_or_create(parse_config(raw), say=lambda _: None)

    store = Store.open(tmp_path / "s.zarr", mode="r+")
    manifest = store.manifest.to_json()
    del manifest["weights_fingerprint"]
    manifest["final_state"] = manifest.pop("final_states")[0]  # as schema 2 kept it
    store.group.attrs["manifest"] = {**manifest, "schema_version": 2}
    raw["model"]["path"] = str(moved)
    with pytest.raises(ResumeConflict, match="has store schema 2, made by an earlier release"):
        open_or_create(parse_config(raw), say=lambda _: None)


def set_immutable(path: Path, on: bool) -> None:
    """`chattr -R +i`: unwritable even by root, unlike a chmod (the tests may run as root)."""
    subprocess.run(["chattr", "-R", "+i" if on else "-i", str(path)], check=True)


def test_a_store_made_read_only_mid_job_fails_its_shards_cleanly_and_the_job_says_so(
    two_nodes: Cluster, deepseek_path: Path, tmp_path: Path
) -> None:
    probe = tmp_path / "probe"
    probe.mkdir()
    try:
        set_immutable(probe, True)
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"chattr +i is not available here: {exc}")
    set_immutable(probe, False)
    rows = write_prompts(tmp_path / "prompts.jsonl", 12)
    url = tmp_path / "s.zarr"
    raw = job_config(deepseek_path, tmp_path / "prompts.jsonl", url, tmp_path)
    raw["worker"]["max_node_failures"] = 1  # one failed worker per node, then the job stops
    log: list[str] = []
    driver = Driver(parse_config(raw), say=log.append)
    result: list[int] = []
    thread = threading.Thread(target=lambda: result.append(driver.run()))
    thread.start()
    deadline = time.monotonic() + 400
    while store_committed(url) < 1:
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
        assert 1 <= len(committed) < len(store.shards)
        report = verify(url)
        assert {f.check for f in report.findings if f.level == "error"} == {"commits"}
        assert_store_matches_reference(store, deepseek_path, committed)
    finally:
        set_immutable(url, False)

    # Writable again: the same job resumes and finishes, every sample exactly once.
    assert run_job(parse_config(raw), say=lambda _: None) == 0
    assert_exactly_once(Store.open(url), rows, deepseek_path)


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
    two_nodes: Cluster, deepseek_path: Path, tmp_path: Path
) -> None:
    raw = job_config(deepseek_path, tmp_path / "prompts.jsonl", tmp_path / "s.zarr", tmp_path)
    driver = Driver(parse_config(raw))
    queue = ShardQueueActor.remote([0, 1])
    worker = JustCommitted.remote(queue)
    driver.workers[ray.put(None)] = _Running("node", "w", worker)
    meter = ProgressMeter(total_samples=6, total_tokens=60)

    assert "samples 3/6" in driver._progress(meter, queue)[0]
