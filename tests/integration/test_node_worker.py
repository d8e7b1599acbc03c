"""The node worker on a real local Ray with a real SGLang server (CPU, tiny DeepseekV3)."""

from __future__ import annotations

import os
import signal
import stat
import time
import traceback
from pathlib import Path

import numpy as np
import pytest
import ray
import torch
from ray.cluster_utils import Cluster
from transformers import AutoTokenizer

from actors.calibration import PROBE_TEXT, CalibrationError, calibrate
from actors.node_worker import ModelMismatch, NodeWorker
from actors.sglang_server import ServerError
from cluster.shard_queue import ShardQueueActor
from hsx_store.builder import create_store
from hsx_store.format import Store, make_manifest, stored_arrays
from hsx_store.layers import expected_capture
from hsx_store.reader import HiddenStatesDataset
from tests.helpers.hf_reference import TOLERANCE, assert_matches
from tests.helpers.jobs import (
    CPU_PLAN,
    LAYERS,
    assert_misaligned_rows_fail,
    assert_store_matches_reference,
    plan_store,
    start_worker,
    worker_job,
)
from tests.helpers.models import fine_tuned_copy
from tests.helpers.prompts import chat_prompts
from tests.helpers.ray_cluster import SOLO_NODE
from tests.helpers.servers import DEEPSEEK_FLOAT32, RID_PREFIX, ServerPool


def test_worker_writes_two_shards_matching_reference_and_plan_through_a_server_restart(
    ray_nodes: Cluster, deepseek_path: Path, tmp_path: Path
) -> None:
    """Its server runs `--dp-size 2`: two schedulers, each numbering its own dumps from 0, so
    the calibration probe's counter is one rank's only, and each rank dumps into a folder of
    its own (dp0/, dp1/). SIGKILLed mid-shard, the server is restarted, dumping into a folder
    of its own (its writer makes it once the dead one's unpublished files are gone), and the
    shard completes."""
    store = plan_store(deepseek_path, tmp_path / "store.zarr", count=10, per_shard=5)
    planned_ids = np.asarray(store.group["input_ids"][:]).copy()
    planned_mask = np.asarray(store.group["loss_mask"][:]).copy()
    queue = ShardQueueActor.remote(range(len(store.shards)), lease_seconds=60)
    config = worker_job(
        deepseek_path,
        tmp_path / "store.zarr",
        tmp_path,
        server={"dp_size": 2},
        worker={"inflight": 2},
    )
    worker, run = start_worker(config, queue, written=2)
    rank_folders = {p.name for p in tmp_path.glob("hsx-dumps-*/server-0/dp*")}
    os.killpg(ray.get(worker.server_pid.remote()), signal.SIGKILL)
    (dumps,) = tmp_path.glob("hsx-dumps-*")
    deadline = time.monotonic() + 300
    while not (dumps / "server-1").is_dir():
        assert time.monotonic() < deadline, "no restart"
        time.sleep(0.1)
    dead = [p.name for p in dumps.glob("server-0/**/*")]
    assert not [name for name in dead if name.startswith((".tmp-", ".pool-", ".ring"))]
    while not ray.wait([run], timeout=0.1)[0]:
        assert time.monotonic() < deadline + 300, "the worker did not finish"
        rank_folders |= {f"1/{p.name}" for p in dumps.glob("server-1/dp*")}
    summaries = ray.get(run)

    assert rank_folders == {"dp0", "dp1", "1/dp0", "1/dp1"}, "both DP ranks, both servers"
    summaries.sort(key=lambda s: s["shard"])
    assert [s["shard"] for s in summaries] == [0, 1]
    # A count, carried across shards: 1 from the shard the kill fell in. That is shard 0 unless
    # shard 0's last samples were written between the status poll and the kill.
    restarts = [s["server_restarts"] for s in summaries]
    assert restarts in ([1, 1], [0, 1]), "one restart, counted from the shard it fell in"
    assert all(s["written"] == 5 and not s["failed"] for s in summaries)
    assert ray.get(queue.status.remote()).finished
    store = Store.open(tmp_path / "store.zarr")
    assert_store_matches_reference(store, deepseek_path, [0, 1])
    assert_misaligned_rows_fail(store, deepseek_path, 2)
    # The plan's own rows are untouched by the workers.
    assert np.array_equal(store.group["input_ids"][:], planned_ids)
    assert np.array_equal(store.group["loss_mask"][:], planned_mask)
    assert planned_mask.any() and not planned_mask.all()
    assert not list(tmp_path.glob("hsx-dumps-*")), "the worker leaves no dumps behind"
    assert not list(tmp_path.glob("hsx-worker-*")), "nor its server's log, having succeeded"


def test_an_fp8_store_quantized_by_the_server_matches_the_reference_and_the_writers_bytes(
    ray_nodes: Cluster, llama_path: Path, tmp_path: Path
) -> None:
    """store.dtype fp8_e4m3 from a bf16 server (tiny Llama). Quantized in the server (the
    default): the reader's bf16 rows match HF within TOLERANCE["fp8_e4m3"], and the same rows
    one token late do not. The same plan with the writer quantizing bf16 dumps stores the same
    bytes: one request in flight on each server, so the same batches and bf16 rows."""
    ids, masks = chat_prompts(llama_path, 6)
    manifest = make_manifest(
        str(llama_path),
        llama_path,
        expected_capture(llama_path, LAYERS, "bfloat16"),
        max_length=4096,
        samples_per_shard=6,
        chunk_tokens=64,
        dtype="fp8_e4m3",
    )
    runs = {}
    for quantizer, node in (("server", SOLO_NODE), ("writer", "sglang_node")):  # side by side
        url = tmp_path / f"{quantizer}.zarr"
        create_store(url, manifest, [f"sample-{i}" for i in range(6)], ids, masks)
        queue = ShardQueueActor.remote([0], lease_seconds=60)
        config = worker_job(
            llama_path,
            url,
            tmp_path,
            dtype="bfloat16",
            worker={"inflight": 1},
            store={"fp8_quantizer": quantizer},
        )
        worker = NodeWorker.options(resources={node: 1}).remote(config, queue, plan=CPU_PLAN)
        runs[quantizer] = (worker, worker.run.remote())
    stores = {}
    for quantizer, (_, run) in runs.items():
        (summary,) = ray.get(run, timeout=600)
        assert summary["written"] == 6 and not summary["failed"]
        assert summary["fp8_quantized_by"] == quantizer
        stores[quantizer] = Store.open(tmp_path / f"{quantizer}.zarr")
    for array in stored_arrays(manifest):
        server, writer = (np.asarray(s.group[array.name][:]) for s in stores.values())
        assert np.array_equal(server, writer), f"{array.name}: the server's bytes differ"

    store = stores["server"]
    assert store.group["aux_hidden_states"].dtype == np.uint8
    data, n = HiddenStatesDataset(str(tmp_path / "server.zarr")), len(LAYERS)
    for k in range(6):
        sample = data[k]
        aux = sample["aux_hidden_states"].reshape(len(sample["input_ids"]), n, -1)
        assert_matches(
            llama_path,
            sample["input_ids"].tolist(),
            store.manifest.layer_ids,
            aux,
            sample["final_hidden_states"],
            **TOLERANCE["fp8_e4m3"],
            what=f"sample {k}",
            prenorm=sample["prenorm_hidden_states"],
        )
    late = data[3]  # its rows one token late: the previous token's first
    ids3 = late["input_ids"].tolist()
    aux = torch.cat([data[2]["aux_hidden_states"][-1:], late["aux_hidden_states"][:-1]])
    final = torch.cat([data[2]["final_hidden_states"][-1:], late["final_hidden_states"][:-1]])
    with pytest.raises(AssertionError, match="late: aux differs"):
        assert_matches(
            llama_path,
            ids3,
            store.manifest.layer_ids,
            aux.reshape(len(ids3), n, -1),
            final,
            **TOLERANCE["fp8_e4m3"],
            what="late",
        )


def test_calibration_refuses_a_server_whose_layers_differ_from_the_manifest(
    sglang_servers: ServerPool, deepseek_path: Path
) -> None:
    """What a worker does first with a new server (a failure stops it before it leases)."""
    served = sglang_servers.get(DEEPSEEK_FLOAT32)  # captures layers [0, 1, 3]
    probe = AutoTokenizer.from_pretrained(deepseek_path)(PROBE_TEXT)["input_ids"]
    cases = [
        ([0, 1, 3], "float32", None),  # what it serves: calibrated
        ([0, 2], "float32", r"layer_ids: server \[0, 1, 3\] != manifest \[0, 2\]"),
        ([0, 1, 3], "bfloat16", r"dtype: server 'float32' != manifest's served dtype 'bfloat16'"),
    ]
    for layers, dtype, problem in cases:
        capture = expected_capture(deepseek_path, layers, dtype)
        manifest = make_manifest(
            str(deepseek_path), deepseek_path, capture, max_length=64, samples_per_shard=4
        )
        if problem is None:
            assert calibrate(served.server, manifest, probe, RID_PREFIX).probe_tokens == len(probe)
            continue
        with pytest.raises(CalibrationError, match=problem):
            calibrate(served.server, manifest, probe, RID_PREFIX)


def test_a_worker_whose_node_has_another_checkpoint_refuses_before_any_work(
    ray_nodes: Cluster, deepseek_path: Path, tmp_path: Path
) -> None:
    plan_store(deepseek_path, tmp_path / "store.zarr", count=2, per_shard=2)
    queue = ShardQueueActor.remote([0], lease_seconds=60)
    tuned = fine_tuned_copy(deepseek_path, tmp_path / "tuned")  # the node's copy at model.path
    config = worker_job(tuned, tmp_path / "store.zarr", tmp_path)
    worker = NodeWorker.options(resources={SOLO_NODE: 1}).remote(config, queue, plan=CPU_PLAN)
    with pytest.raises(ModelMismatch, match=f"{tuned}: weights_fingerprint"):
        ray.get(worker.run.remote(), timeout=120)
    ray.kill(worker)  # a failed worker holds its node until stopped, as the driver does
    status = ray.get(queue.status.remote())
    assert status.pending == 1 and status.completed == 0
    assert not list(tmp_path.glob("hsx-worker-*/server.log")), "no server was started"


def test_worker_whose_lease_is_revoked_stops_writing_and_does_not_commit(
    ray_nodes: Cluster, deepseek_path: Path, tmp_path: Path
) -> None:
    store = plan_store(deepseek_path, tmp_path / "store.zarr", count=40, per_shard=40)
    queue = ShardQueueActor.remote([0], lease_seconds=60)
    config = worker_job(deepseek_path, tmp_path / "store.zarr", tmp_path, worker={"inflight": 1})
    worker, run = start_worker(config, queue, written=2)
    # The shard is revoked and handed to another holder at once (Ray runs one caller's calls
    # to an actor in order), so this worker cannot lease it again; it waits for work.
    queue.revoke.remote(0)
    other = ray.get(queue.acquire.remote("another-worker"))
    assert other.shard == 0
    deadline = time.monotonic() + 300
    while ray.get(worker.status.remote())["phase"] != "idle":
        assert time.monotonic() < deadline, "the worker kept the revoked shard"
        assert ray.get(queue.heartbeat.remote(other.lease_id))
        time.sleep(0.2)

    # Every dump captured or read for the lost shard was released (none would be, before).
    assert ray.get(worker.status.remote())["dumps_held"] == 0
    store = Store.open(tmp_path / "store.zarr")
    assert not store.committed()[0] and store.summary(0) is None
    # Nothing of the samples after the revocation reached the store.
    written_rows = np.asarray(store.group["final_hidden_states"][:]).any(axis=1)
    last = store.sample_rows(store.shards[0].sample_end - 1)
    assert not written_rows[last].any()
    # The other holder finishes the job: the waiting worker stops.
    assert ray.get(queue.claim.remote(other.lease_id))
    assert ray.get(queue.complete.remote(other.lease_id, {}))
    (summary,) = ray.get(run, timeout=600)
    assert summary["lease_lost"] is True
    assert "lease lost (the queue refused" in summary["lease_lost_cause"]
    assert summary["written"] < 40


def test_worker_fails_with_the_log_tail_when_the_server_cannot_start(
    ray_nodes: Cluster, deepseek_path: Path, tmp_path: Path
) -> None:
    plan_store(deepseek_path, tmp_path / "store.zarr", count=2, per_shard=2)
    queue = ShardQueueActor.remote([0], lease_seconds=60)
    config = worker_job(
        deepseek_path, tmp_path / "store.zarr", tmp_path, server={"extra_args": ["--no-such-flag"]}
    )
    worker = NodeWorker.options(resources={SOLO_NODE: 1}).remote(config, queue, plan=CPU_PLAN)
    with pytest.raises(ServerError, match="no-such-flag") as failure:
        ray.get(worker.run.remote(), timeout=300)
    ray.kill(worker)  # a failed worker holds its node until stopped, as the driver does
    # A failed worker keeps its server's log (private), and says where.
    (log,) = tmp_path.glob("hsx-worker-*/server.log")
    assert "no-such-flag" in log.read_text()
    assert str(log) in "".join(traceback.format_exception(failure.value))
    assert stat.S_IMODE(log.stat().st_mode) == 0o600
    assert stat.S_IMODE(log.parent.stat().st_mode) == 0o700
