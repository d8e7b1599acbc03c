"""Jobs and workers on real servers in tests: their configs, and the checks every such test
makes of the store they leave (exactly once, the plan's tokens, the HF reference's rows)."""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import ray
import torch
import yaml
from transformers import AutoTokenizer

from actors.config import WorkerJobConfig
from actors.node_plan import NodePlan
from actors.node_worker import NodeWorker
from hsx_store.builder import create_store
from hsx_store.format import Store, make_manifest
from hsx_store.layers import expected_capture
from tests.helpers.hf_reference import TOLERANCE, assert_matches
from tests.helpers.prompts import chat_prompts
from tests.helpers.ray_cluster import SOLO_NODE

# float32 serving, as in test_capture_server: bf16 MoE routing flips experts on near-ties.
DTYPE = "float32"

LAYERS = [0, 1, 3]


def plan_store(model_path: Path, url: Path, count: int, per_shard: int) -> Store:
    """A minimal plan over `chat_prompts`."""
    ids, masks = chat_prompts(model_path, count)
    names = [f"sample-{i}" for i in range(count)]
    manifest = make_manifest(
        str(model_path),
        model_path,
        expected_capture(model_path, LAYERS, DTYPE),
        max_length=4096,
        samples_per_shard=per_shard,
        chunk_tokens=64,
    )
    return create_store(url, manifest, names, ids, masks)


def worker_job(
    model_path: Path,
    store_url: Path,
    tmp_path: Path,
    *,
    dtype: str = DTYPE,
    layers: list[int] | None = LAYERS,
    server: dict | None = None,
    worker: dict | None = None,
    store: dict | None = None,
) -> WorkerJobConfig:
    """A worker's config for tests: short timeouts, files under tmp_path."""
    return WorkerJobConfig.model_validate(
        {
            "model": {"path": str(model_path), "dtype": dtype, "aux_layer_ids": layers},
            "store": {"url": str(store_url), **(store or {})},
            "server": {"start_timeout_s": 240, "restart_backoff_s": 0.5, **(server or {})},
            "worker": {
                "inflight": 4,
                "dump_root": str(tmp_path),
                "log_root": str(tmp_path),
                "heartbeat_s": 0.5,
                **(worker or {}),
            },
        }
    )


# What the driver's placement gives a worker of one server on a CPU node: the tests' workers.
CPU_PLAN = NodePlan.on_cpu(1, None)


def start_worker(config: WorkerJobConfig, queue: ray.actor.ActorHandle, written: int) -> tuple:
    """Start a worker's run and return (worker, run) once it has written `written` samples."""
    worker = NodeWorker.options(resources={SOLO_NODE: 1}).remote(config, queue, plan=CPU_PLAN)
    run = worker.run.remote()
    deadline = time.monotonic() + 300
    while ray.get(worker.status.remote())["written"] < written:
        assert time.monotonic() < deadline, "the worker made no progress"
        time.sleep(0.1)
    return worker, run


def assert_store_matches_reference(store: Store, model_path: Path, shards: list[int]) -> None:
    g = store.group
    for k in shards:
        shard = store.shards[k]
        assert store.committed()[k]
        for i in range(shard.sample_begin, shard.sample_end):
            rows = store.sample_rows(i)
            ids = g["input_ids"][rows].tolist()
            aux = torch.from_numpy(np.asarray(g["aux_hidden_states"][rows]))
            final = torch.from_numpy(np.asarray(g["final_hidden_states"][rows]))
            prenorm = torch.from_numpy(np.asarray(g["prenorm_hidden_states"][rows]))
            assert_matches(
                model_path,
                ids,
                store.manifest.layer_ids,
                aux,
                final,
                **TOLERANCE[DTYPE],
                what=f"sample {i}",
                prenorm=prenorm,
            )
        assert (g["sample_status"][shard.sample_begin : shard.sample_end] == 1).all()


def assert_misaligned_rows_fail(store: Store, model_path: Path, i: int) -> None:
    """The comparison can fail on this store: sample i's rows read one token late, and the
    next sample's rows taken for sample i's (i and i + 1 in the same shard)."""
    g = store.group
    rows, theirs = store.sample_rows(i), store.sample_rows(i + 1)
    ids = g["input_ids"][rows].tolist()
    n = min(rows.stop - rows.start, theirs.stop - theirs.start)
    late = slice(rows.start - 1, rows.stop - 1)
    swapped = slice(theirs.start, theirs.start + n)
    for what, ids_, at in (("late", ids, late), ("swapped", ids[:n], swapped)):
        aux = torch.from_numpy(np.asarray(g["aux_hidden_states"][at]))
        final = torch.from_numpy(np.asarray(g["final_hidden_states"][at]))
        with pytest.raises(AssertionError, match=f"{what}: aux differs"):
            assert_matches(
                model_path,
                ids_,
                store.manifest.layer_ids,
                aux,
                final,
                **TOLERANCE[DTYPE],
                what=what,
            )


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


def dry_run(tmp_path: Path, model: Path, rows: list[dict[str, Any]], *argv: str) -> int:
    """`run --dry-run` of the tests' job over `rows`, with `argv` added (--set, --store)."""
    from cluster.__main__ import main

    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    raw = job_config(model, tmp_path / "prompts.jsonl", tmp_path / "s.zarr", tmp_path)
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(raw))
    return main(["run", "--config", str(tmp_path / "job.yaml"), "--dry-run", *argv])


@functools.cache
def tokenizer_of(model: Path) -> Any:
    return AutoTokenizer.from_pretrained(model)


def expected_ids(model: Path, row: dict[str, Any]) -> list[int]:
    """The row's tokens, computed here independently of the plan: a chat row as SGLang's own
    `/v1/chat/completions` code hands it to the template."""
    from tests.helpers.sglang_chat import served_template_inputs

    tokenizer = tokenizer_of(model)
    if "text" in row:
        return tokenizer(row["text"])["input_ids"]
    messages, tools = served_template_inputs(row["messages"], row.get("tools"))
    out = tokenizer.apply_chat_template(messages, tools=tools, tokenize=True, return_dict=True)
    return list(out["input_ids"])


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


def store_committed(url: Path | str, storage_options: dict[str, Any] | None = None) -> int:
    try:
        return int(Store.open(url, storage_options=storage_options).committed().sum())
    except Exception:  # not created yet
        return 0


def start_driver(config: Path, ray_address: str, log: Path) -> subprocess.Popen[bytes]:
    """`python -m cluster run` as `ray job submit` starts it, its output added to `log`."""
    with log.open("ab") as out:
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


@dataclass(frozen=True)
class FinishedJob:
    url: Path
    rows: list[dict[str, Any]]  # the good input rows, in order
    log: list[str]  # what the driver said
    config: dict[str, Any]
    killed: str  # the worker killed mid-job
    killed_slot: int  # its server slot on the node
    captured_while_planning: bool  # a shard was committed while the plan was incomplete
    leftovers: list[str]  # what the job left on the node: hsx-* folders, server segments
    trainer: Path  # the example trainer's folder: checkpoint.pt, draft/, log-1.txt, log-2.txt
    followed: list[tuple[str, str]]  # (sample id, digest) as a follow reader yielded them
    follow_ended: str | None  # why that reader stopped
    status_running: dict[str, Any]  # `python -m cluster status` of the job while it ran
    queue_nodes: dict[str, str]  # each of the job's shard queues (actor id): the node it ran on
