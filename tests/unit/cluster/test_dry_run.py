"""`python -m cluster run --dry-run`: every problem named (exit 2), the rows planned and rejected
said, nothing started or written."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from cluster.__main__ import main
from tests.helpers.jobs import job_config


def dry_run(tmp_path: Path, model: Path, rows: list[dict]) -> int:
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    raw = job_config(model, tmp_path / "prompts.jsonl", tmp_path / "s.zarr", tmp_path)
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(raw))
    return main(["run", "--config", str(tmp_path / "job.yaml"), "--dry-run"])


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
    assert "dry run: 0 problem(s)" in out and not (tmp_path / "s.zarr").exists()


def test_a_missing_input_is_named(
    deepseek_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    raw = job_config(deepseek_path, tmp_path / "nowhere.jsonl", tmp_path / "s.zarr", tmp_path)
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(raw))
    assert main(["run", "--config", str(tmp_path / "job.yaml"), "--dry-run"]) == 2
    assert "problem: data.paths: " in capsys.readouterr().out
