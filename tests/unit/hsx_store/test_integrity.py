"""The store verifier: structural checks on small synthetic stores (no servers); the checks
that need the model are tests/integration/test_verify_model_checks.py's."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import zarr

from cluster.__main__ import main
from hsx_store import format as store_format
from hsx_store.format import Store
from hsx_store.integrity_report import CHECKS
from tests.helpers.reports import check_lines, errors, verify
from tests.helpers.synthetic import FAILED, LENGTHS, build_store


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
    assert main(["verify", "--store", str(path)]) == 0
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
    assert main(["verify", "--store", str(path)]) == 1


def test_plan_rows_changed_after_creation_are_named_with_their_shard(tmp_path: Path) -> None:
    path = build_store(tmp_path / "s.zarr")
    zarr.open_group(path, mode="r+")["input_ids"][0:5] = 0  # sample 0's prompt, now all zero
    report = verify(path)
    [error] = errors(report, "plan")
    assert error.startswith(
        "shard 0 (samples 0..3 (s0 .. s3)): input_ids / loss_mask rows are not the plan "
        "recorded at creation"
    )
    assert check_lines(report)["plan"] == "FAIL" and main(["verify", "--store", str(path)]) == 1


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
    assert main(["verify", "--store", str(path)]) == 1


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
    assert main(["verify", "--store", str(path)]) == status


def test_a_store_of_the_previous_schema_still_verifies(tmp_path: Path) -> None:
    """Schema 2 had no weights fingerprint; its stores stay readable (and verifiable)."""
    path = build_store(tmp_path / "s.zarr")

    def to_schema_2(attrs: dict) -> None:
        del attrs["manifest"]["weights_fingerprint"]
        attrs["manifest"]["schema_version"] = 2
        attrs["manifest"]["final_state"] = attrs["manifest"].pop("final_states")[0]
        for schema_6_field in ("image_token_id", "position_ids"):
            del attrs["manifest"][schema_6_field]

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
    assert f"{path}/zarr.json is damaged: zarr cannot read it" in errors(verify(path))[0]
    assert main(["verify", "--store", str(path)]) == 2
    assert main(["verify", "--store", str(tmp_path / "nothing.zarr")]) == 2


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


def test_a_verify_run_opens_the_store_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One client and one read of zarr.json (on S3: requests, not just time)."""
    path = build_store(tmp_path / "s.zarr")
    opened: list[str] = []
    open_location = store_format.open_location

    def counted(url, *args, **kwargs):
        opened.append(str(url))
        return open_location(url, *args, **kwargs)

    monkeypatch.setattr(store_format, "open_location", counted)
    assert verify(path).ok
    assert opened == [str(path)]


def test_every_damaged_chunk_is_named_and_the_checks_go_on_past_them(tmp_path: Path) -> None:
    """A truncated chunk, an empty one and a truncated input_ids chunk, in three shards: each
    is named with its array, key, shard and samples, and a NaN in another row is still found.
    Before: one "the check crashed: ValueError: ..." and nothing after it."""
    path = build_store(tmp_path / "s.zarr")
    g = zarr.open_group(path, mode="r+")
    g["final_hidden_states"][37, 3] = 0x7FC0  # sample 5's token 2: NaN
    chunk = path / "final_hidden_states" / "c" / "1" / "0"  # rows 8..15: sample 2, shard 0
    chunk.write_bytes(chunk.read_bytes()[:-7])
    (path / "aux_hidden_states" / "c" / "9" / "0" / "0").write_bytes(b"")  # rows 72..79, shard 2
    k = 40 // g["input_ids"].chunks[0]  # the plan's chunk holding row 40: shard 1
    ids_chunk = path / "input_ids" / "c" / str(k)
    ids_chunk.write_bytes(ids_chunk.read_bytes()[:-3])
    report = verify(path)

    damaged = errors(report, "chunks")
    assert len(damaged) == 3
    assert damaged[0].startswith("input_ids: chunk")
    assert "of committed shard 1 cannot be read (" in damaged[0]
    assert damaged[1].startswith(
        "final_hidden_states: chunk 1 (key final_hidden_states/c/1/0, rows 8..15) of committed "
        "shard 0 cannot be read ("
    )
    assert damaged[1].endswith("): sample 2 (s2) unchecked there")
    assert damaged[2].startswith(
        "aux_hidden_states: chunk 9 (key aux_hidden_states/c/9/0/0, rows 72..79) of committed "
        "shard 2 cannot be read ("
    )
    assert damaged[2].endswith("): samples 8..9 (s8 .. s9) unchecked there")
    assert errors(report, "values") == [
        "sample 5 (s5): 1 rows of final_hidden_states hold non-finite values, first row 37 "
        "(token 2 of the sample)"
    ]
    assert not [f for f in report.findings if "crashed" in f.message]
    assert main(["verify", "--store", str(path)]) == 1


def test_a_sample_id_stored_twice_is_named(tmp_path: Path) -> None:
    path = build_store(tmp_path / "s.zarr")
    ids = zarr.open_group(path, mode="r+")["sample_id"]
    ids[4] = ids[1]
    report = verify(path)
    assert report.exit_code == 1
    assert errors(report) == ["sample id 's1' is stored for 2 samples: 1, 4"]
