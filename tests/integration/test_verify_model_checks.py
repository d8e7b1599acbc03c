"""verify's model checks on real servers: the recompute (float32, and bf16 with a real model's
batch noise) and the logprob check pass real captures and name samples whose rows are wrong."""

from __future__ import annotations

import re
import shutil
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from actors.capture_client import generate_and_capture, wait_for_dump
from actors.shard_writer import ShardWriter
from cluster.verify import verify as verify_command
from cluster.verify.logprobs import LogprobCheck
from cluster.verify.model_check import checked_samples
from cluster.verify.recompute import RecomputeCheck
from cluster.verify.recompute_bound import NOISE_FLOOR, NOISE_MULTIPLE
from cluster.verify.server import VerifyServer
from hsx_store.builder import create_store
from hsx_store.format import Store, make_manifest
from hsx_store.integrity import verify_store
from hsx_store.integrity_report import CHECKS, VerifyReport
from hsx_store.layers import expected_capture
from patches.dump_files import read_dump, release_dump
from tests.helpers.jobs import FinishedJob
from tests.helpers.noisy_model import noisy_llama
from tests.helpers.reports import check_lines, errors

WORDS = "a draft model learns what the target model would say next at every token".split()


def failing_samples(report: VerifyReport) -> set[int]:
    return {int(m.split()[1]) for m in errors(report, "recompute")}


def test_recompute_and_logprobs_pass_a_real_float32_job_and_name_a_wrong_sample(
    deepseek_job: FinishedJob, deepseek_path: Path, tmp_path: Path
) -> None:
    url = Path(shutil.copytree(deepseek_job.url, tmp_path / "s.zarr"))
    # Every sample recomputed (the agent's too: tools, a call, its result), three checked by
    # logprobs. One has plausible final rows that are not what the model computes (scaled by
    # 1.5): it alone fails, by both checks; the others pass.
    store = Store.open(url, mode="r+")
    everyone = store.num_samples
    checked = {
        "recomputed": checked_samples(store, everyone, 0),
        "logprobs": checked_samples(store, 3, 0),
    }
    assert "agent-10" in {str(store.group["sample_id"][i]) for i in checked["recomputed"]}
    victim = checked["logprobs"][1]
    label = f"{victim} ({store.group['sample_id'][victim]})"
    rows, final = store.sample_rows(victim), store.group["final_hidden_states"]
    final[rows] = np.asarray(final[rows]) * 1.5
    said: list[str] = []
    kw = dict(
        model_path=str(deepseek_path), recompute=everyone, logprobs=3, dump_root=str(tmp_path)
    )
    report = verify_command(url, say=said.append, **kw)  # --dtype from the store's manifest
    print(report.format())

    expected = dict.fromkeys(CHECKS, "OK") | {"recompute": "FAIL", "logprobs": "FAIL"}
    assert check_lines(report) == expected
    assert sum("starting SGLang" in line for line in said) == 1, "one server for both checks"
    for key, samples in checked.items():
        results = {r["sample"]: r["ok"] for r in report.checked[key]}
        assert results == {i: i != victim for i in samples}, (key, results)
    name = f"sample {label}: final_hidden_states"
    messages = errors(report, "recompute")
    assert messages and all(m.startswith(name) for m in messages), messages
    assert any(
        re.match(rf"{re.escape(name)} differs from a fresh recompute by 50\.0", m) for m in messages
    )
    logprobs = f"sample {label}: stored final states do not give the server's"
    assert [m.split(" logprobs:")[0] for m in errors(report, "logprobs")] == [logprobs]
    assert not list(tmp_path.glob("hsx-verify-*")), "the verifier leaves no dumps behind"


LAYERS = [0, 1, 2]  # as asked of SGLang
SAMPLES = 8
PROMPTS = [
    " ".join(WORDS[(i * 5 + k) % len(WORDS)] for k in range(2 + i * 6)) for i in range(SAMPLES)
]


def captured_store(
    model: Path,
    url: Path,
    dtype: str,
    server: VerifyServer,
    layers: list[int] = LAYERS,
    texts: list[str] = PROMPTS,
) -> Store:
    """A store of SAMPLES prompts whose rows `server` captured, all requests at once (batched
    as a job's are), written and committed as a worker does."""
    tokenizer = AutoTokenizer.from_pretrained(model)
    ids = [np.array(tokenizer(t)["input_ids"], np.int32) for t in texts]
    capture = expected_capture(model, layers, dtype)
    manifest = make_manifest(str(model), model, capture, max_length=256, samples_per_shard=4)
    names = [f"p{i}" for i in range(SAMPLES)]
    store = create_store(url, manifest, names, ids, [np.ones(len(x), np.uint8) for x in ids])
    running, _ = server.get(store)

    def capture_one(i: int) -> tuple[torch.Tensor, ...]:
        response = generate_and_capture(running, f"hsx-test-{i}", input_ids=ids[i].tolist())
        tensors, _ = read_dump(wait_for_dump(response.dump_path))
        rows = tuple(tensors[name].clone() for name in manifest.hidden_arrays)
        release_dump(response.dump_path)
        return rows

    with ThreadPoolExecutor(SAMPLES) as pool:
        rows = list(pool.map(capture_one, range(SAMPLES)))
    for shard in store.shards:
        writer = ShardWriter(store, shard)
        for i in range(shard.sample_begin, shard.sample_end):
            writer.write_sample(i, *rows[i])
        writer.commit({"worker": "test"})
    return store


def check(url: Path, server: VerifyServer, *, recompute: bool = False) -> VerifyReport:
    """Every check, with the logprob check of every sample on `server` (or the recompute)."""
    say = partial(print, flush=True)
    kw = dict(server=server, count=SAMPLES, seed=0, say=say)
    if recompute:
        report = verify_store(url, recompute=partial(RecomputeCheck.run_check, **kw), say=say)
    else:
        report = verify_store(url, logprobs=partial(LogprobCheck.run_check, **kw), say=say)
    print(report.format())
    return report


# Llama in bf16 on CPU is batch-invariant (alone and batched recomputes bit-identical) until
# chunked prefill splits prompts: a batch then moves each prompt's chunk boundaries, and bf16
# rows differ by the model's rounding.
CHUNKED_PREFILL = ("--chunked-prefill-size", "16")
# Each from BOS, as a chat template's prompts are (the noisy model's row of massive activations).
BOS_PROMPTS = [
    "<|bos|>" + " ".join(WORDS[(i * 5 + k) % len(WORDS)] for k in range(3 + i * 4))
    for i in range(SAMPLES)
]


@pytest.fixture(scope="module")
def noisy_path(llama_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """llama-tiny made as noisy in bf16 as a real model, with a massive BOS row."""
    return noisy_llama(llama_path, tmp_path_factory.mktemp("models") / "llama-tiny-noisy")


def swap_rows(store: Store, a: int, b: int) -> None:
    """Samples a's and b's rows exchanged in every hidden array (as many as the shorter has)."""
    n = int(min(store.sample_length[a], store.sample_length[b]))
    at_a, at_b = (slice(int(store.sample_start[i]), int(store.sample_start[i]) + n) for i in (a, b))
    for name in store.manifest.hidden_arrays:
        array = store.group[name]
        rows_a, rows_b = np.asarray(array[at_a]), np.asarray(array[at_b])
        array[at_a], array[at_b] = rows_b, rows_a


def shift_rows(store: Store, i: int) -> None:
    """Sample i's rows one token off in every hidden array: row t holds token t + 1's state
    (the last one the next sample's first)."""
    rows = store.sample_rows(i)
    for name in store.manifest.hidden_arrays:
        array = store.group[name]
        array[rows] = np.asarray(array[rows.start + 1 : rows.stop + 1])


def scale_final_rows(store: Store, i: int) -> None:
    final, rows = store.group["final_hidden_states"], store.sample_rows(i)
    scaled = np.asarray(final[rows]).view(ml_dtypes.bfloat16).astype(np.float32) * 1.5
    final[rows] = scaled.astype(ml_dtypes.bfloat16).view(np.uint16)


def next_layer_rows(store: Store, i: int) -> None:
    """Sample i's first aux layer holding the second one's rows (a capture of the wrong layer)."""
    aux, rows = store.group["aux_hidden_states"], store.sample_rows(i)
    data = np.asarray(aux[rows])
    data[:, 0] = data[:, 1]
    aux[rows] = data


def displace_final_rows(store: Store, i: int, by: float) -> None:
    """Sample i's final rows each `by` away from where they were (relative RMS; every value
    moved by that fraction, up or down at random): rows another batch might have given."""
    final, rows = store.group["final_hidden_states"], store.sample_rows(i)
    values = np.asarray(final[rows]).view(ml_dtypes.bfloat16).astype(np.float32)
    signs = np.random.default_rng(0).choice([-1.0, 1.0], values.shape)
    final[rows] = (values * (1 + by * signs)).astype(ml_dtypes.bfloat16).view(np.uint16)


def test_recompute_holds_each_bf16_sample_to_the_noise_of_all_and_names_wrong_samples(
    noisy_path: Path, tmp_path: Path, verify_server: Callable[..., VerifyServer]
) -> None:
    """Defect 7 of issue 33: a sample's own alone-vs-batched noise can be 0 (its two recomputes
    prefilled alike) while its stored rows, prefilled in other batches, differ by the model's
    usual bf16 noise: a real model's is above the floor, so the bound comes from every checked
    sample's. The store's rows are this server's captures, all eight at once; whether a capture
    differs from a recompute is a draw (CI saw every correct one equal a recompute bit for bit),
    so sample 0, whose recomputes agree, has its final rows moved by 6% outright: more than 4 x
    the floor, less than the model's noise allows."""
    url = tmp_path / "s.zarr"
    server = verify_server(noisy_path, ["--dtype", "bfloat16", *CHUNKED_PREFILL])
    store = captured_store(noisy_path, url, "bfloat16", server, [2, 4, 5], BOS_PROMPTS)
    # Four of the eight samples made wrong (4 two ways, one per array); the other four must pass.
    a, b, shifted, scaled, layer = 1, 3, 2, 4, 4  # 2's next row is 3's first (3 ends a shard)
    wrong = {a, b, shifted, scaled, layer}
    swap_rows(store, a, b)
    shift_rows(store, shifted)
    scale_final_rows(store, scaled)
    next_layer_rows(store, layer)
    displace_final_rows(store, 0, 0.06)
    report = check(url, server, recompute=True)

    results = report.checked["recomputed"]
    assert len(results) == 8
    final = [r["arrays"]["final_hidden_states"] for r in results]
    floor = NOISE_FLOOR["bfloat16"]
    # A real model's noise: batching moves final rows by more than the floor, and some sample's
    # two recomputes agree bit for bit (p0 fits one chunk and is sent first: at least it), its
    # bound then set by the others' noise.
    assert max(f["noise"] for f in final) > floor, final
    assert all(f["noise"] == 0.0 for f in results[0]["arrays"].values()), results[0]
    assert results[0]["arrays"]["final_hidden_states"]["bound"] > NOISE_MULTIPLE * floor
    # Sample 0's rows are further from both recomputes than a bound of its own noise (0) and
    # the floor lets them be (the old rule's), and pass.
    assert results[0]["arrays"]["final_hidden_states"]["distance"] > NOISE_MULTIPLE * floor
    assert results[0]["ok"], results[0]
    clean = [f for r in results if r["sample"] not in wrong for f in r["arrays"].values()]
    for name in store.manifest.hidden_arrays:  # every sample held to the same pooled noise
        assert len({r["arrays"][name]["pooled_noise"] for r in results}) == 1
    assert min(f["other_distance"] for f in clean) > 0.3
    assert failing_samples(report) == wrong, report.format()
    messages = errors(report, "recompute")
    for i in (a, b, shifted):
        for name in store.manifest.hidden_arrays:
            assert any(m.startswith(f"sample {i} (p{i}): {name} differs") for m in messages)
    assert any(
        m.startswith(f"sample {layer} (p{layer}): aux_hidden_states differs") for m in messages
    )
    assert not any(m.startswith(f"sample {layer} (p{layer}): prenorm") for m in messages)
    [scaled_error] = [
        m
        for m in messages
        if m.startswith(f"sample {scaled} (p{scaled}): final_hidden_states differs")
    ]
    # 1.5 x the rows is 50% off (bf16 rounding of the product aside), named with the sample's
    # own noise, the pooled one and the bound.
    assert re.search(
        r"by (49|50)\.\d+% \(largest per-row relative RMS, token \d+\); alone vs batched "
        r"recompute (\d\.\d+%|\d\.\d+e[-+]\d+), \d\.\d+% over the 8 samples checked \(upper "
        r"quartile\); bound \d+\.\d+% = 4 x max\(those, floor 1e-02\)",
        scaled_error,
    ), scaled_error
    for i, j in ((a, b), (b, a)):  # and each is nearest to the other's recompute
        for name in store.manifest.hidden_arrays:
            assert any(
                m.startswith(f"sample {i} (p{i}): {name} tokens 1..")
                and f"from sample {j} (p{j})'s recompute" in m
                for m in messages
            ), messages
    _, dumps = server.get(store)
    assert not list(dumps.glob("req_*")), "the recompute leaves no dump unreleased"


def test_logprobs_pass_a_captured_store_and_name_rows_swapped_or_shifted(
    llama_path: Path, tmp_path: Path, verify_server: Callable[..., VerifyServer]
) -> None:
    """bf16, the dtype with batch noise; float32 (deepseek-v3-tiny) is checked, with the
    recompute on the same server, in test_recompute_passes_on_a_real_float32_job."""
    path, dtype = llama_path, "bfloat16"
    url = tmp_path / "s.zarr"
    server = verify_server(path, ["--dtype", dtype])
    store = captured_store(path, url, dtype, server)
    report = check(url, server)
    assert report.ok and report.checks["logprobs"] == "ran", report.format()
    assert [r["ok"] for r in report.checked["logprobs"]] == [True] * SAMPLES

    # Sample 3's final rows replaced by sample 7's first ones; sample 5's shifted by a token.
    final = store.group["final_hidden_states"]
    r3, r5, r7 = (store.sample_rows(i) for i in (3, 5, 7))
    final[r3] = np.asarray(final[r7])[: r3.stop - r3.start]
    final[r5] = np.roll(np.asarray(final[r5]), 1, axis=0)
    report = check(url, server)
    failed = [m.split(": stored final")[0] for m in (f.message for f in report.findings)]
    assert failed == ["sample 3 (p3)", "sample 5 (p5)"], report.format()
    assert [r["sample"] for r in report.checked["logprobs"] if not r["ok"]] == [3, 5]
