"""`python -m cluster run --dry-run`: every problem named (exit 2), the rows planned and rejected
said, nothing started or written."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml

from cluster import plan_sources
from cluster.__main__ import main
from cluster.config import parse_config
from cluster.job_store import open_or_create, plan_into
from tests.helpers.jobs import dry_run, job_config
from tests.helpers.locked import locked_folder

GOOD = {"id": "good", "text": "a draft model learns what the target would say"}
BAD = {"id": "bad", "text": ""}


def test_a_missing_weights_file_a_bad_row_and_a_good_one_are_each_said(
    deepseek_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    model = Path(shutil.copytree(deepseek_path, tmp_path / "model"))
    for weights in model.glob("*.safetensors"):
        weights.unlink()

    assert dry_run(tmp_path, model, [BAD, GOOD]) == 2
    out = capsys.readouterr().out
    assert f"problem: model.path: {model}: no weight files" in out
    assert "planned the first 1 of 1 parts: 1 samples" in out and "1 rejected" in out
    assert "rejected bad: empty text" in out
    assert "dry run: 1 problem(s); nothing was started or written" in out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["job.yaml", "model", "prompts.jsonl"]


def test_a_good_job_says_its_layers_and_projected_storage(
    deepseek_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    assert dry_run(tmp_path, deepseek_path, [GOOD, {**GOOD, "id": "also-good"}]) == 0
    out = capsys.readouterr().out
    assert "capture: layers [0, 1, 3] + final" in out
    assert "projected: 2 samples" in out and "storage estimate" in out
    assert f"store: none at {tmp_path / 's.zarr'} yet: `run` makes it there" in out
    assert "dry run: 0 problem(s)" in out and not (tmp_path / "s.zarr").exists()


def test_a_missing_input_is_named(
    deepseek_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    raw = job_config(deepseek_path, tmp_path / "nowhere.jsonl", tmp_path / "s.zarr", tmp_path)
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(raw))
    assert main(["run", "--config", str(tmp_path / "job.yaml"), "--dry-run"]) == 2
    assert "problem: data.paths: " in capsys.readouterr().out


def files_under(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def test_a_store_url_that_run_would_refuse_is_a_problem_naming_it_and_nothing_is_written(
    deepseek_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """A regular file at store.url (or above it), a folder holding something else, a store of
    another job: each a problem (exit 2) naming the URL and why, as `run` refuses it; the job's
    own store is resumed (exit 0)."""
    file = tmp_path / "file.zarr"
    file.write_text("not a store")
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "notes.txt").write_text("not a store")
    for url, reason in (
        (file, f"{file}: it is a file; a store is a directory"),
        (file / "s.zarr", f"{file / 's.zarr'}: {file} is a file; a store is a directory"),
        (taken, f"{taken}: not empty (it holds 'notes.txt')"),
    ):
        assert dry_run(tmp_path, deepseek_path, [GOOD], "--store", str(url)) == 2
        assert f"problem: store.url: {reason}" in capsys.readouterr().out
    assert file.read_text() == "not a store"

    theirs = tmp_path / "theirs.zarr"
    config = parse_config(job_config(deepseek_path, tmp_path / "prompts.jsonl", theirs, tmp_path))
    _, _, builder = open_or_create(config, say=lambda _: None)
    plan_into(builder, config, 0, lambda shards: None)
    before = files_under(theirs)
    assert dry_run(tmp_path, deepseek_path, [GOOD], "--store", str(theirs)) == 0
    out = capsys.readouterr().out
    assert f"store: {theirs} is this job's, 0/1 shards committed: `run` resumes it" in out
    other = ["--store", str(theirs), "--set", "model.aux_layer_ids=[0,2]"]
    assert dry_run(tmp_path, deepseek_path, [GOOD], *other) == 2
    out = capsys.readouterr().out
    assert f"problem: store.url: {theirs} was made by a different job" in out
    assert "layer_ids: store [0, 1, 3] != config [0, 2]" in out
    assert files_under(theirs) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "file.zarr", "job.yaml", "prompts.jsonl", "taken", "theirs.zarr"
    ]  # fmt: skip


def test_a_store_url_in_a_folder_no_one_may_write_in_is_a_problem(
    deepseek_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    with locked_folder(tmp_path / "locked") as locked:
        assert dry_run(tmp_path, deepseek_path, [GOOD], "--store", str(locked / "s.zarr")) == 2
        out = capsys.readouterr().out
        assert f"problem: store.url: {locked / 's.zarr'}: {locked} is not writable" in out
        assert list(locked.iterdir()) == []


def test_every_row_rejected_is_a_problem_saying_why_and_planning_goes_on_to_a_sample(
    deepseek_path: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A generate job with no room for max_new_tokens in any prompt: `run` would stop with "no
    usable samples" (exit 2 here, each kind of reason said). Rows rejected in the first parts
    alone are no problem: planning goes on past them to the first sample."""
    ask = {"role": "user", "content": GOOD["text"]}
    chats = [{"id": f"chat-{i}", "messages": [ask]} for i in range(3)]
    assert dry_run(tmp_path, deepseek_path, chats, "--set", "generate.max_new_tokens=250") == 2
    out = capsys.readouterr().out
    said = "problem: planning: no usable samples: all 3 rows were rejected\n  3 x, first chat-0: "
    assert said + "no room to generate: " in out and "(max_new_tokens 250 + 1 end-of-turn)" in out
    assert "projected" not in out
    assert dry_run(tmp_path, deepseek_path, chats, "--set", "generate.max_new_tokens=16") == 0
    assert "planned the first 1 of 1 parts: 3 samples" in capsys.readouterr().out

    monkeypatch.setattr(plan_sources, "PART_BYTES", 8)  # a part per row
    rows = [{**BAD, "id": f"bad-{i}"} for i in range(9)] + [GOOD]
    assert dry_run(tmp_path, deepseek_path, rows) == 0
    out = capsys.readouterr().out
    assert "planned the first 8 of" not in out  # no sample in those
    assert ": 1 samples, " in out and "9 rejected" in out and "dry run: 0 problem(s)" in out
