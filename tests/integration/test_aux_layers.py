"""Five aux layers captured by a real server on the tiny Llama match HF transformers slot by
slot, through calibration, the node worker, the reader and the speculators export."""

from __future__ import annotations

from pathlib import Path

import pytest
import ray
import torch
from ray.cluster_utils import Cluster
from safetensors.torch import load_file

from actors.node_worker import NodeWorker
from cluster.shard_queue import ShardQueueActor
from hsx_store.builder import create_store
from hsx_store.export.run import export, sample_path
from hsx_store.format import Store, make_manifest
from hsx_store.layers import expected_capture
from hsx_store.reader import HiddenStatesDataset
from tests.helpers.hf_reference import TOLERANCE, assert_matches
from tests.helpers.jobs import CPU_PLAN, worker_job
from tests.helpers.prompts import chat_prompts
from tests.helpers.ray_cluster import SOLO_NODE

# Llama resolves each asked id to id + 1: the asked edges 0 and L-2 are HF indices 1 and L-1,
# and the order asked does not matter (SGLang captures in layer order).
ASKED = [6, 0, 3, 2, 5]

LAYERS = [1, 3, 4, 6, 7]

DTYPE = "bfloat16"


def test_five_layers_from_a_real_server_match_hf_through_store_reader_and_export(
    llama_path: Path, tmp_path: Path, ray_nodes: Cluster
) -> None:
    url = tmp_path / "store.zarr"
    ids, masks = chat_prompts(llama_path, 8)
    capture = expected_capture(llama_path, ASKED, DTYPE)
    assert capture["layer_ids"] == LAYERS and capture["num_aux"] == 5
    manifest = make_manifest(
        str(llama_path), llama_path, capture, max_length=4096, samples_per_shard=4, chunk_tokens=64
    )
    create_store(url, manifest, [f"sample-{i}" for i in range(8)], ids, masks)
    config = worker_job(llama_path, url, tmp_path, dtype=DTYPE, layers=ASKED)
    queue = ShardQueueActor.remote([0, 1], lease_seconds=60)
    worker = NodeWorker.options(resources={SOLO_NODE: 1}).remote(config, queue, plan=CPU_PLAN)
    summaries = ray.get(worker.run.remote(), timeout=600)  # calibration checks 5 layers
    assert sorted(s["written"] for s in summaries) == [4, 4]
    assert not any(s["failed"] for s in summaries)

    store = Store.open(url)
    assert store.group["aux_hidden_states"].shape[1:] == (5, 128)
    ds = HiddenStatesDataset(str(url))
    out = tmp_path / "speculators"
    export(str(url), out, "speculators", say=lambda _: None)
    tol = TOLERANCE[DTYPE]  # per-row min cosine and RMS error, measured in hf_reference.py
    for i in range(8):
        sample = ds[i]
        t = len(ids[i])
        assert sample["aux_hidden_states"].shape == (t, 5 * 128)
        aux, final = sample["aux_hidden_states"].reshape(t, 5, 128), sample["final_hidden_states"]
        # Each of the 5 slots is HF's hidden_states[LAYERS[j]] for this very prompt.
        prenorm = sample["prenorm_hidden_states"]
        assert_matches(
            llama_path,
            ids[i].tolist(),
            LAYERS,
            aux,
            final,
            **tol,
            what=f"sample {i}",
            prenorm=prenorm,
        )
        hidden = load_file(sample_path(out, "speculators", i))["hidden_states"]
        assert hidden.shape == (t, 6, 128)  # the 5 aux slots, then the final state
        assert torch.equal(int_bits(hidden[:, :5]), int_bits(aux))
        assert torch.equal(int_bits(hidden[:, 5]), int_bits(prenorm))  # speculators' teacher

    # The comparison can fail: sample 1 with two slots swapped, and read one token late (its
    # first row taken from sample 0's last, as rows [start - 1, stop - 1) would be).
    t, previous, sample = len(ids[1]), ds[0], ds[1]
    aux, final = sample["aux_hidden_states"].reshape(t, 5, 128), sample["final_hidden_states"]
    late_aux = torch.cat([previous["aux_hidden_states"][-1:], sample["aux_hidden_states"][:-1]])
    late_final = torch.cat([previous["final_hidden_states"][-1:], final[:-1]])
    wrong = {
        "swapped": (aux[:, [0, 1, 3, 2, 4]], final),
        "late": (late_aux.reshape(t, 5, 128), late_final),
    }
    for what, (wrong_aux, wrong_final) in wrong.items():
        with pytest.raises(AssertionError, match=f"{what}: aux differs"):
            assert_matches(
                llama_path, ids[1].tolist(), LAYERS, wrong_aux, wrong_final, **tol, what=what
            )


def int_bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)
