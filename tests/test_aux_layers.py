"""Any number of aux layers, 1 to 8 (EAGLE-3 uses 3, DFlash-style drafters 5 or more): the job
config refuses what SGLang cannot capture before anything starts, layer ids resolve per model
family at any count, the store, readers, verifier and speculators export keep 1 and 8 layers
bit for bit, and a real SGLang server on the tiny Llama captures 5 layers that match HF
transformers slot by slot, through calibration, the node worker, the reader and the export."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import ray
import torch
from safetensors.torch import load_file

from actors.node_worker import NodeWorker
from actors.shard_writer import ShardWriter
from cluster.__main__ import main as cli_main
from cluster.config import MAX_AUX_LAYERS, ConfigError, parse_config
from cluster.job_store import manifest_for
from cluster.shard_queue import ShardQueueActor
from hsx_store.export import export, read_exported, sample_path
from hsx_store.format import Store, create_store, make_manifest
from hsx_store.integrity import verify_store
from hsx_store.layers import expected_capture, requested_layer_ids, resolve_layer_ids
from hsx_store.reader import HiddenStatesDataset
from tests.hf_reference import TOLERANCE, assert_matches
from tests.local_ray import local_ray
from tests.test_node_worker import chat_prompts, worker_job
from tests.test_store import manifest as store_manifest


def job(model: Path, tmp_path: Path, aux_layer_ids: list[int] | None) -> dict:
    (tmp_path / "prompts.jsonl").write_text('{"text": "hello"}\n')
    return {
        "model": {"path": str(model), "aux_layer_ids": aux_layer_ids},
        "data": {"paths": [str(tmp_path / "prompts.jsonl")]},
        "store": {"url": str(tmp_path / "s.zarr")},
    }


# -- the job config ------------------------------------------------------------------------------


@pytest.mark.parametrize("ids", [[4], [0, 2, 3, 5, 6], list(range(MAX_AUX_LAYERS))])
def test_config_takes_1_to_8_distinct_layer_ids(tmp_path: Path, ids: list[int]) -> None:
    assert parse_config(job(tmp_path, tmp_path, ids)).model.aux_layer_ids == ids


@pytest.mark.parametrize(
    "ids,reason",
    [
        ([], r"must name 1 to 8 layers, got 0"),
        (list(range(9)), r"must name 1 to 8 layers, got 9"),
        ([3, 1, 5, 1, 3], r"distinct, \[1, 3\] repeated"),
        ([2, -1, 4], r"non-negative"),
    ],
)
def test_config_refuses_bad_layer_ids_naming_the_field(
    tmp_path: Path, ids: list[int], reason: str
) -> None:
    with pytest.raises(ConfigError, match=rf"model\.aux_layer_ids: Value error, .*{reason}"):
        parse_config(job(tmp_path, tmp_path, ids))


def test_ids_the_model_lacks_are_a_config_error_before_anything_starts(
    llama_path: Path, deepseek_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """SGLang 0.5.23 checks only id < num_hidden_layers: Llama's id L-1 (index L, after the
    last layer) would pass its startup check and crash the first forward."""
    ok = {
        (llama_path, (0, 2, 3, 5, 6)): [1, 3, 4, 6, 7],  # Llama adds 1: 0..L-2 -> 1..L-1
        (deepseek_path, (3, 0, 2, 1)): [0, 1, 2, 3],  # as given: 0..L-1, in any order
    }
    for (model, ids), layers in ok.items():
        assert manifest_for(parse_config(job(model, tmp_path, list(ids))), None).layer_ids == layers
    bad = {
        (llama_path, (0, 2, 3, 5, 7)): r"\[1, 3, 4, 6, 8\] \(Llama-style: each \+ 1, so ask "
        r"for 0\.\.6\); \[8\] cannot be captured from this 8-layer model",
        (deepseek_path, (0, 2, 4)): r"\[4\] cannot be captured from this 4-layer model",
        (deepseek_path, (1, 2, 3)): r"indices \[2, 3, 4\] \(DeepSeek-style: as given, each \+ 1 "
        r"if the first is 1\); \[4\]",
    }
    for (model, ids), message in bad.items():
        with pytest.raises(ConfigError, match=rf"model\.aux_layer_ids: .*{message}"):
            manifest_for(parse_config(job(model, tmp_path, list(ids))), None)

    # The command line: exit 2 with the field named, before a store (or Ray) is made.
    given = job(llama_path, tmp_path, None)
    args = ["run", "--model", str(llama_path), "--data", given["data"]["paths"][0]]
    args += ["--store", given["store"]["url"], "--set", "model.aux_layer_ids=[0,2,3,5,7]"]
    assert cli_main(args) == 2
    err = capsys.readouterr().err
    assert "error: invalid job config:\n  model.aux_layer_ids: aux layer ids [0, 2, 3, 5, 7]" in err
    assert not (tmp_path / "s.zarr").exists()


# -- layer ids per model family, at any count ----------------------------------------------------


@pytest.mark.parametrize(
    "arch,asked,layers",
    [
        ("LlamaForCausalLM", [0], [1]),
        ("LlamaForCausalLM", [59, 0, 14, 29, 44], [1, 15, 30, 45, 60]),  # the edges 0 and L-2
        ("LlamaForCausalLM", list(range(0, 57, 8)), list(range(1, 58, 8))),
        ("DeepseekV3ForCausalLM", [0], [0]),
        ("DeepseekV3ForCausalLM", [60, 0, 15, 30, 45], [0, 15, 30, 45, 60]),  # 0 and L-1
        ("DeepseekV3ForCausalLM", [1, 2, 10, 20, 30], [2, 3, 11, 21, 31]),  # a first 1: all + 1
        ("DeepseekV3ForCausalLM", [2, 1, 10, 20, 30], [1, 2, 10, 20, 30]),  # 1 not first: as given
        ("KimiK25ForConditionalGeneration", list(range(1, 60, 8)), list(range(2, 61, 8))),
    ],
)
def test_any_number_of_ids_resolves_and_asks_back(
    arch: str, asked: list[int], layers: list[int]
) -> None:
    config = {"architectures": [arch], "num_hidden_layers": 61, "hidden_size": 8}
    assert resolve_layer_ids(config, asked) == layers
    again = requested_layer_ids(config, layers)  # what `verify --recompute` asks a server for
    assert resolve_layer_ids(config, again) == layers


# -- the store, readers, verifier and export at 1 and 8 layers -----------------------------------

H, LENGTHS = 16, [5, 12, 1, 9, 30, 4]


def bits_of(i: int, num_aux: int) -> tuple[np.ndarray, np.ndarray]:
    """Sample i's raw bf16 rows, every slot its own values (finite: verify checks that)."""
    rng = np.random.default_rng(1000 * num_aux + i)
    aux = rng.standard_normal((LENGTHS[i], num_aux, H), np.float32) + np.arange(num_aux)[:, None]
    final = rng.standard_normal((LENGTHS[i], H), np.float32)
    return aux.astype(ml_dtypes.bfloat16).view(np.uint16), final.astype(ml_dtypes.bfloat16).view(
        np.uint16
    )


def written_store(path: Path, num_aux: int) -> Store:
    manifest = dataclasses.replace(
        store_manifest(codec={"name": "zstd", "level": 1}),
        layer_ids=list(range(1, 2 * num_aux, 2)),
        num_aux=num_aux,
        hidden_size=H,
        chunk_tokens=8,
        samples_per_shard=3,
    )
    rng = np.random.default_rng(num_aux)
    ids = [rng.integers(0, 1000, n).astype(np.int32) for n in LENGTHS]
    masks = [np.ones(n, np.uint8) for n in LENGTHS]
    store = create_store(path, manifest, [f"s{i}" for i in range(len(LENGTHS))], ids, masks)
    for shard in store.shards:
        writer = ShardWriter(store, shard, threads=1)
        for i in range(shard.sample_begin, shard.sample_end):
            aux, final = bits_of(i, num_aux)
            writer.write_sample(i, aux.view(ml_dtypes.bfloat16), final.view(ml_dtypes.bfloat16))
        writer.commit({"worker": "w"})
    return store


def raw(t: torch.Tensor) -> np.ndarray:
    return t.view(torch.int16).numpy().view(np.uint16)


@pytest.mark.parametrize("num_aux", [1, MAX_AUX_LAYERS])
def test_store_reader_verify_and_speculators_export_keep_every_slot(
    tmp_path: Path, num_aux: int
) -> None:
    url = str(tmp_path / "s.zarr")
    store = written_store(tmp_path / "s.zarr", num_aux)
    assert store.group["aux_hidden_states"].shape[1:] == (num_aux, H)
    assert verify_store(url, say=lambda _: None).ok
    ds = HiddenStatesDataset(url)
    out = tmp_path / "speculators"
    export(url, out, "speculators", allow_post_norm=True, say=lambda _: None)  # slots, here
    for i, n in enumerate(LENGTHS):
        aux, final = bits_of(i, num_aux)
        sample = ds[i]
        assert sample["aux_hidden_states"].shape == (n, num_aux * H)
        np.testing.assert_array_equal(raw(sample["aux_hidden_states"]), aux.reshape(n, -1))
        np.testing.assert_array_equal(raw(sample["final_hidden_states"]), final)
        hidden = load_file(sample_path(out, "speculators", i))["hidden_states"]
        assert hidden.shape == (n, num_aux + 1, H)  # the aux slots, then the final state
        np.testing.assert_array_equal(raw(hidden[:, :num_aux]), aux)
        np.testing.assert_array_equal(raw(hidden[:, num_aux]), final)
        back = read_exported(out, "speculators", i)
        np.testing.assert_array_equal(raw(back["aux_hidden_states"]), aux.reshape(n, -1))


def test_the_round_trip_check_can_fail(tmp_path: Path) -> None:
    """The comparison above tells the slots apart: a store holding sample 1's slots in another
    order (as a reader mixing them up would return) fails it."""
    store = written_store(tmp_path / "s.zarr", 5)
    rows = store.sample_rows(1)
    arr = store.group["aux_hidden_states"]
    arr[rows] = np.asarray(arr[rows])[:, [0, 1, 3, 2, 4]]
    aux, _ = bits_of(1, 5)
    got = raw(HiddenStatesDataset(str(tmp_path / "s.zarr"))[1]["aux_hidden_states"])
    assert np.array_equal(got[:, : 2 * H], aux[:, :2].reshape(len(aux), -1))
    with pytest.raises(AssertionError):
        np.testing.assert_array_equal(got, aux.reshape(len(aux), -1))


# -- five layers captured by a real server ---------------------------------------------------------

# Llama resolves each asked id to id + 1: the asked edges 0 and L-2 are HF indices 1 and L-1,
# and the order asked does not matter (SGLang captures in layer order).
ASKED = [6, 0, 3, 2, 5]
LAYERS = [1, 3, 4, 6, 7]
DTYPE = "bfloat16"


@pytest.mark.slow
def test_five_layers_from_a_real_server_match_hf_through_store_reader_and_export(
    llama_path: Path, tmp_path: Path
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
    with local_ray(1):
        queue = ShardQueueActor.remote([0, 1], lease_seconds=60)
        worker = NodeWorker.options(resources={"sglang_node": 1}).remote(config, queue)
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
