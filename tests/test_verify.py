"""The store verifier: structural checks on small synthetic stores (no servers), and one real
job whose rows are recomputed on a fresh SGLang server (slow)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import ray
import zarr

from actors.shard_writer import ShardWriter
from cluster.config import parse_config
from cluster.driver import run_job
from cluster.verify import main, recompute_choice
from cluster.verify import verify as verify_command
from hsx_store.format import Manifest, Store, create_store
from hsx_store.integrity import CHECKS, VerifyReport
from hsx_store.layers import requested_layer_ids, resolve_layer_ids
from tests.local_ray import local_ray as start_local_ray
from tests.test_store import LENGTHS, NUM_AUX, H
from tests.test_store import manifest as store_manifest

FAILED = {6: "token ids differ from the plan"}  # a failed sample, named in its summary


def manifest(dtype: str) -> Manifest:
    return store_manifest(dtype, {"name": "none"})


def rows(i: int, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """Plausible hidden rows of sample i: finite, never zero."""
    rng = np.random.default_rng(100 + i)
    aux = rng.standard_normal((LENGTHS[i], NUM_AUX, H), np.float32) + 3
    final = rng.standard_normal((LENGTHS[i], H), np.float32) + 3
    if dtype == "bfloat16":
        return aux.astype(ml_dtypes.bfloat16), final.astype(ml_dtypes.bfloat16)
    return aux, final


def build_store(
    path: Path | str,
    dtype: str = "bfloat16",
    shards: tuple[int, ...] = (0, 1, 2),
    storage_options: dict | None = None,
) -> Path | str:
    rng = np.random.default_rng(0)
    ids = [rng.integers(0, 1000, n).astype(np.int32) for n in LENGTHS]
    masks = [np.ones(n, np.uint8) for n in LENGTHS]
    names = [f"s{i}" for i in range(len(LENGTHS))]
    rejected = [{"sample_id": "bad", "reason": "too long"}]
    store = create_store(
        path, manifest(dtype), names, ids, masks, rejected=rejected, storage_options=storage_options
    )
    for k in shards:
        shard = store.shards[k]
        writer = ShardWriter(store, shard)
        for i in range(shard.sample_begin, shard.sample_end):
            if i in FAILED:
                writer.mark_failed(i, FAILED[i])
            else:
                writer.write_sample(i, *rows(i, dtype))
        writer.commit({"worker": "test"})
    return path


def verify(path: Path, **kw) -> VerifyReport:
    report = verify_command(path, say=lambda _: None, **kw)
    print(report.format())
    return report


def errors(report: VerifyReport, check: str | None = None) -> list[str]:
    return [
        f.message
        for f in report.findings
        if f.level == "error" and (check is None or f.check == check)
    ]


def check_lines(report: VerifyReport) -> dict[str, str]:
    """check name -> OK / FAIL / SKIP, from the formatted report."""
    lines = [line.split() for line in report.format().splitlines()[1 : 1 + len(CHECKS)]]
    return {words[1]: words[0] for words in lines}


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a_good_store_passes_every_check(tmp_path: Path, dtype: str, capsys) -> None:
    path = build_store(tmp_path / "s.zarr", dtype)
    report = verify(path)

    assert report.ok and not report.findings
    skipped = ("recompute", "logprobs")
    assert check_lines(report) == {
        **dict.fromkeys(CHECKS[:-2], "OK"),
        **dict.fromkeys(skipped, "SKIP"),
    }
    c = report.checked
    assert (c["samples"], c["shards"], c["committed_shards"]) == (11, 3, 3)
    assert (c["samples_written"], c["samples_failed"], c["samples_not_committed"]) == (10, 1, 0)
    assert c["failed"] == [
        {"sample": 6, "sample_id": "s6", "reason": FAILED[6], "shard": 1},
    ]
    assert c["rejected"] == [{"sample_id": "bad", "reason": "too long"}]
    assert c["rows_checked"] == 2 * sum(LENGTHS) and c["chunks_checked"] > 0
    assert main(["--store", str(path)]) == 0
    out = capsys.readouterr().out
    assert "result: OK" in out and "bad: too long" in out and "s6: token ids differ" in out


def test_a_removed_chunk_is_named_with_its_array_and_samples(tmp_path: Path) -> None:
    path = build_store(tmp_path / "s.zarr")
    # Rows 40..47 are chunk 5: inside sample 5 (rows 35..54) alone.
    (path / "aux_hidden_states" / "c" / "5" / "0" / "0").unlink()
    report = verify(path)

    assert errors(report, "chunks") == [
        "aux_hidden_states: chunk 5 (key aux_hidden_states/c/5/0/0, rows 40..47) of committed "
        "shard 1 is missing: sample 5 (s5) read zeros there"
    ]
    assert errors(report, "values") == [
        "sample 5 (s5) rows 40..47 of aux_hidden_states are all zero: chunk missing?"
    ]
    assert check_lines(report)["chunks"] == "FAIL" and check_lines(report)["arrays"] == "OK"
    assert main(["--store", str(path)]) == 1


def test_plan_rows_changed_after_creation_are_named_with_their_shard(tmp_path: Path) -> None:
    path = build_store(tmp_path / "s.zarr")
    zarr.open_group(path, mode="r+")["input_ids"][0:5] = 0  # sample 0's prompt, now all zero
    report = verify(path)
    [error] = errors(report, "plan")
    assert error.startswith(
        "shard 0 (samples 0..3 (s0 .. s3)): input_ids / loss_mask rows are not the plan "
        "recorded at creation"
    )
    assert check_lines(report)["plan"] == "FAIL" and main(["--store", str(path)]) == 1


def test_a_chunk_shared_by_samples_names_each(tmp_path: Path) -> None:
    path = build_store(tmp_path / "s.zarr")
    (path / "final_hidden_states" / "c" / "0" / "0").unlink()  # rows 0..7: samples 0, 1, 2
    report = verify(path)
    assert errors(report, "chunks") == [
        "final_hidden_states: chunk 0 (key final_hidden_states/c/0/0, rows 0..7) of committed "
        "shard 0 is missing: samples 0..2 (s0 .. s2) read zeros there"
    ]
    assert len(errors(report, "values")) == 3


def test_a_flipped_commit_marker_names_the_shard_and_its_samples(tmp_path: Path) -> None:
    path = build_store(tmp_path / "s.zarr")
    zarr.open_group(path, mode="r+")["shard_committed"][1] = 0
    report = verify(path)

    assert errors(report) == ["shard 1 not committed: samples 4..7 (s4 .. s7) missing"]
    assert report.checked["samples_not_committed"] == 4
    assert report.checked["rows_checked"] == 2 * (sum(LENGTHS) - sum(LENGTHS[4:8]))
    assert report.exit_code == 1


def test_a_shard_never_written_and_one_marked_committed_without_rows(tmp_path: Path) -> None:
    path = build_store(tmp_path / "s.zarr", shards=(0,))
    zarr.open_group(path, mode="r+")["shard_committed"][2] = 1
    report = verify(path)

    assert errors(report, "commits") == [
        "shard 1 not committed: samples 4..7 (s4 .. s7) missing",
        "shard 2 is committed but samples 8..10 (s8 .. s10): status 0 (planned), not written",
        "shard 2 is committed but has no summary",
    ]
    assert {m.split(" (key")[0] for m in errors(report, "chunks")} == {
        f"{name}: chunk {k}" for name in ("aux_hidden_states", "final_hidden_states")
        for k in (8, 9, 10, 11)
    }  # fmt: skip
    assert main(["--store", str(path)]) == 1


def test_a_summary_that_disagrees_with_the_statuses_fails(tmp_path: Path) -> None:
    path = build_store(tmp_path / "s.zarr")
    g = zarr.open_group(path, mode="r+")
    summary = json.loads(str(g["shard_summary"][1]))
    g["shard_summary"][1] = json.dumps({**summary, "written": 4, "failed": {}})
    g["shard_summary"][2] = "{not json"
    report = verify(path)
    assert errors(report, "commits") == [
        "shard 1: summary says written 4, sample_status says 3",
        "sample 6 (s6) has status 2 (failed) but shard 1's summary gives no reason for it",
        "shard 2: summary is not valid JSON (Expecting property name enclosed in double quotes: "
        "line 1 column 2 (char 1))",
    ]


def edit_manifest(path: Path, edit) -> None:
    meta = json.loads((path / "zarr.json").read_text())
    edit(meta["attributes"])
    (path / "zarr.json").write_text(json.dumps(meta))


@pytest.mark.parametrize(
    "edit,status,message",
    [
        (lambda a: a["manifest"].update(hidden_size=16), 1, "aux_hidden_states: shape (96, 3, 8)"),
        (
            lambda a: a["manifest"].update(schema_version=99),
            2,
            "schema version 99 is not supported",
        ),
        (lambda a: a.pop("manifest"), 2, "has no 'manifest' attribute"),
        (lambda a: a.update(manifest="garbage"), 2, "is not a JSON object: got str 'garbage'"),
        (
            lambda a: a["manifest"].update(hidden_size="8"),
            2,
            "field hidden_size must be int, got str '8'",
        ),
        (lambda a: a["manifest"].pop("chunk_tokens"), 2, "missing ['chunk_tokens']"),
        (lambda a: a["manifest"].pop("weights_fingerprint"), 2, "missing ['weights_fingerprint']"),
        (lambda a: a["manifest"].update(dtype="float16"), 2, "float32 or fp8_e4m3, got"),
        (lambda a: a["manifest"].update(max_length=4), 1, "sample 0 (s0): length 5 > max_length 4"),
    ],
)
def test_a_corrupted_manifest_is_named(tmp_path: Path, edit, status: int, message: str) -> None:
    path = build_store(tmp_path / "s.zarr")
    edit_manifest(path, edit)
    report = verify(path)

    assert report.exit_code == status
    assert any(message in m for m in errors(report)), errors(report)
    if status == 2:
        assert check_lines(report) == {
            "manifest": "FAIL",
            **dict.fromkeys(CHECKS[1:], "SKIP"),
        }
        assert f"{path}/zarr.json" in errors(report)[0]
    assert main(["--store", str(path)]) == status


def test_a_store_of_the_previous_schema_still_verifies(tmp_path: Path) -> None:
    """Schema 2 had no weights fingerprint; its stores stay readable (and verifiable)."""
    path = build_store(tmp_path / "s.zarr")

    def to_schema_2(attrs: dict) -> None:
        del attrs["manifest"]["weights_fingerprint"]
        attrs["manifest"]["schema_version"] = 2
        attrs["manifest"]["final_state"] = attrs["manifest"].pop("final_states")[0]

    edit_manifest(path, to_schema_2)
    group = zarr.open_group(path, mode="r+")
    for name in ("sample_start", "sample_length", "shard_plan_sha256"):  # one chunk each then
        data = group[name][:]
        del group[name]
        kept = {"fill_value": ""} if data.dtype.kind in "OTU" else {}
        group.create_array(name, data=data, chunks=(len(data),), **kept)
    report = verify(path)
    assert report.exit_code == 0, report.format()
    assert Store.open(path).manifest.weights_fingerprint is None
    edit_manifest(path, lambda a: a["manifest"].update(weights_fingerprint="w" * 64))
    assert "unknown ['weights_fingerprint']" in errors(verify(path))[0]


def test_unreadable_zarr_json_and_a_missing_store_exit_2(tmp_path: Path) -> None:
    path = build_store(tmp_path / "s.zarr")
    (path / "zarr.json").write_text('{"attributes": ')
    assert "cannot open as a Zarr v3 group" in errors(verify(path))[0]
    assert main(["--store", str(path)]) == 2
    assert main(["--store", str(tmp_path / "nothing.zarr")]) == 2


def test_sample_start_off_the_layout_is_refused(tmp_path: Path) -> None:
    path = build_store(tmp_path / "s.zarr")
    zarr.open_group(path, mode="r+")["sample_start"][3] += 1
    report = verify(path)
    assert report.exit_code == 2
    assert errors(report) == [
        "sample_start disagrees with the deterministic layout at 1 samples, first sample 3: "
        "stored 20, layout 19"
    ]


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_non_finite_values_in_a_written_sample_are_named(tmp_path: Path, dtype: str) -> None:
    path = build_store(tmp_path / "s.zarr", dtype)
    g = zarr.open_group(path, mode="r+")
    nan, inf = (0x7FC0, 0xFF80) if dtype == "bfloat16" else (np.nan, -np.inf)
    g["final_hidden_states"][37, 3] = nan  # sample 5, rows 35..54: its token 2
    g["aux_hidden_states"][38, 2, 0] = inf
    g["aux_hidden_states"][39, 0, 7] = nan
    report = verify(path)

    assert errors(report) == [
        "sample 5 (s5): 2 rows of aux_hidden_states hold non-finite values, first row 38 "
        "(token 3 of the sample)",
        "sample 5 (s5): 1 rows of final_hidden_states hold non-finite values, first row 37 "
        "(token 2 of the sample)",
    ]
    assert check_lines(report)["values"] == "FAIL"


def test_values_are_read_in_bounded_blocks(tmp_path: Path) -> None:
    from hsx_store.integrity import row_flags

    path = build_store(tmp_path / "s.zarr")
    arr = zarr.open_group(path, mode="r")["aux_hidden_states"]
    whole = row_flags(arr, 32, 60)
    for block in (1, 8 * 48, 16 * 48):  # one chunk at least, however small the budget
        assert all(
            np.array_equal(a, b) for a, b in zip(row_flags(arr, 32, 60, block), whole, strict=True)
        )
    assert not whole[0].any()
    assert np.flatnonzero(whole[1]).tolist() == [23, 24]  # rows 55, 56: sample 6, failed


@pytest.mark.parametrize(
    "arch,layers",
    [
        ("DeepseekV3ForCausalLM", [0, 1, 3]),
        ("DeepseekV3ForCausalLM", [1, 3, 5]),  # asked as [3, 5, 1]: a first 1 would shift all
        ("DeepseekV3ForCausalLM", [2, 4, 5]),
        ("KimiK25ForConditionalGeneration", [1, 30, 58]),
        ("LlamaForCausalLM", [1, 4, 7]),
        ("LlamaForCausalLM", [2, 4, 5]),
    ],
)
def test_requested_layer_ids_resolve_back_to_the_stored_ones(arch: str, layers: list[int]) -> None:
    config = {"architectures": [arch], "num_hidden_layers": 61, "hidden_size": 8}
    requested = requested_layer_ids(config, layers)
    assert resolve_layer_ids(config, requested) == layers
    if arch.startswith("Llama"):
        assert requested == [i - 1 for i in layers]


def test_layer_ids_sglang_cannot_be_asked_for_are_refused() -> None:
    llama = {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 8, "hidden_size": 8}
    deepseek = {**llama, "architectures": ["DeepseekV3ForCausalLM"]}
    with pytest.raises(ValueError, match="no --return-aux-hidden-state-layer-ids"):
        requested_layer_ids(llama, [0, 2, 4])  # the embeddings: Llama would need -1
    with pytest.raises(ValueError, match="no --return-aux-hidden-state-layer-ids"):
        requested_layer_ids(deepseek, [1])  # [1] means [2] to DeepSeek


# -- a real job, recomputed on a fresh server ---------------------------------------------------

WORDS = "a draft model learns what the target model would say next at every token".split()


@pytest.fixture
def local_ray() -> Iterator[None]:
    with start_local_ray(1):
        yield


def run_real_job(
    model: Path,
    tmp_path: Path,
    *,
    dtype: str = "float32",
    layer_ids: tuple[int, ...] = (0, 1, 3),
    server_args: tuple[str, ...] = (),
) -> Path:
    data = tmp_path / "prompts.jsonl"
    lines = [
        {"id": f"t{i}", "text": " ".join(WORDS[(i * 5 + k) % len(WORDS)] for k in range(3 + i * 4))}
        for i in range(8)
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in lines))
    config = {
        "model": {"path": str(model), "dtype": dtype, "aux_layer_ids": list(layer_ids)},
        "data": {"paths": [str(data)], "max_length": 256},
        "store": {"url": str(tmp_path / "s.zarr"), "samples_per_shard": 4, "chunk_tokens": 64},
        "server": {
            "max_total_tokens": 8192,
            "start_timeout_s": 300,
            "extra_args": list(server_args),
        },
        "worker": {
            "inflight": 4,
            "heartbeat_s": 0.5,
            "dump_root": str(tmp_path),
            "log_root": str(tmp_path),  # a killed worker keeps its server log: here
        },
        "queue": {"lease_s": 30, "straggler_min_s": 600},
        "driver": {"progress_interval_s": 1},
    }
    assert run_job(parse_config(config), say=lambda _: None) == 0
    return tmp_path / "s.zarr"


def failing_samples(report: VerifyReport) -> set[int]:
    return {int(m.split()[1]) for m in errors(report, "recompute")}


@pytest.mark.slow
def test_recompute_passes_on_a_real_float32_job(
    local_ray: None, deepseek_path: Path, tmp_path: Path
) -> None:
    url = run_real_job(deepseek_path, tmp_path)
    ray.shutdown()  # the verifier needs no Ray
    kw = dict(model_path=str(deepseek_path), recompute=3, logprobs=3, dump_root=str(tmp_path))
    said: list[str] = []
    report = verify_command(url, server_args=["--dtype", "float32"], say=said.append, **kw)
    assert report.ok, report.format()
    assert check_lines(report) == dict.fromkeys(CHECKS, "OK")
    assert [r["ok"] for r in report.checked["recomputed"]] == [True] * 3
    assert [r["ok"] for r in report.checked["logprobs"]] == [True] * 3
    assert sum("starting SGLang" in line for line in said) == 1, "one server for both checks"

    # Plausible values, but not what the model computes: final rows scaled by 1.5.
    store = Store.open(url, mode="r+")
    victim = recompute_choice(store, 3, seed=0)[1]
    rows = store.sample_rows(victim)
    final = store.group["final_hidden_states"]
    final[rows] = np.asarray(final[rows]) * 1.5
    report = verify(url, **kw)  # --dtype now from the store's manifest

    name = f"sample {victim} (t{victim}): final_hidden_states"
    messages = errors(report, "recompute")
    assert messages and all(m.startswith(name) for m in messages), messages
    assert any(
        re.match(rf"{re.escape(name)} differs from a fresh recompute by 50\.0", m) for m in messages
    )
    assert [r["ok"] for r in report.checked["recomputed"]].count(False) == 1
    logprobs = f"sample {victim} (t{victim}): stored final states do not give the server's"
    assert [m.split(" logprobs:")[0] for m in errors(report, "logprobs")] == [logprobs]
    assert not list(tmp_path.glob("hsx-verify-*")), "the verifier leaves no dumps behind"


# Llama in bf16 on CPU is batch-invariant (alone and batched recomputes bit-identical) until
# chunked prefill splits prompts: a batch then moves each prompt's chunk boundaries, and bf16
# rows differ by ~1% (the job's batches of 4 as well as the verifier's).
CHUNKED_PREFILL = ("--chunked-prefill-size", "16")


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


@pytest.mark.slow
def test_recompute_calibrates_to_bf16_batch_noise_and_names_wrong_samples(
    local_ray: None, llama_path: Path, tmp_path: Path
) -> None:
    url = run_real_job(
        llama_path, tmp_path, dtype="bfloat16", layer_ids=(2, 4, 5), server_args=CHUNKED_PREFILL
    )
    ray.shutdown()
    kw = dict(
        model_path=str(llama_path),
        recompute=8,
        dump_root=str(tmp_path),
        server_args=list(CHUNKED_PREFILL),
    )
    report = verify(url, **kw)
    assert report.ok, report.format()
    results = report.checked["recomputed"]
    assert len(results) == 8 and all(r["ok"] for r in results)
    figures = [f for r in results for f in r["arrays"].values()]
    # The batched recompute really differed from the lone one: the noise is measured, not assumed.
    assert max(f["noise"] for f in figures) > 1e-3
    # The job's rows differ from both recomputes (its batches were others), within the bound.
    assert max(f["distance"] for f in figures) > 1e-3
    assert min(f["other_distance"] for f in figures) > 0.3

    store = Store.open(url, mode="r+")
    a, b, shifted, scaled = 1, 6, 2, 5  # 2's next row is 3's first (3 ends a shard)
    swap_rows(store, a, b)
    shift_rows(store, shifted)
    final, rows = store.group["final_hidden_states"], store.sample_rows(scaled)
    scaled_rows = np.asarray(final[rows]).view(ml_dtypes.bfloat16).astype(np.float32) * 1.5
    final[rows] = scaled_rows.astype(ml_dtypes.bfloat16).view(np.uint16)
    report = verify(url, **kw)

    assert failing_samples(report) == {a, b, shifted, scaled}, report.format()
    messages = errors(report, "recompute")
    for i in (a, b, shifted):
        for name in store.manifest.hidden_arrays:
            assert any(m.startswith(f"sample {i} (t{i}): {name} differs") for m in messages)
    [scaled_error] = [
        m
        for m in messages
        if m.startswith(f"sample {scaled} (t{scaled}): final_hidden_states differs")
    ]
    # 1.5 x the rows is 50% off (bf16 rounding of the product aside), named with noise and bound.
    assert re.search(
        r"by (49|50)\.\d+% \(largest per-row relative RMS, token \d+\); alone vs batched "
        r"recompute \d\.\d+%; bound \d\.\d+% = 4 x max",
        scaled_error,
    ), scaled_error
    for i, j in ((a, b), (b, a)):  # and each is nearest to the other's recompute
        for name in store.manifest.hidden_arrays:
            assert any(
                m.startswith(f"sample {i} (t{i}): {name} tokens 0..")
                and f"from sample {j} (t{j})'s recompute" in m
                for m in messages
            ), messages
    assert not list(tmp_path.glob("hsx-verify-*")), "the verifier leaves no dumps behind"
