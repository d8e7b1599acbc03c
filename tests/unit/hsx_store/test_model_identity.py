"""The model identity a store records: the same checkpoint anywhere matches, another does not."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest

from hsx_store.format import make_manifest
from hsx_store.layers import expected_capture
from hsx_store.model_identity import (
    BLOCK_BYTES,
    BLOCKS,
    HEAD_BYTES,
    model_mismatches,
    weights_fingerprint,
)
from tests.helpers.models import fine_tuned_copy


def test_the_same_checkpoint_anywhere_matches_and_a_fine_tune_does_not(
    deepseek_path: Path, tmp_path: Path
) -> None:
    manifest = make_manifest(
        str(deepseek_path),
        deepseek_path,
        expected_capture(deepseek_path, [0, 1, 3], "bfloat16"),
        max_length=64,
        samples_per_shard=2,
    )
    moved = Path(shutil.copytree(deepseek_path, tmp_path / "moved"))
    assert weights_fingerprint(moved) == manifest.weights_fingerprint
    assert model_mismatches(moved, manifest) == []

    tuned = fine_tuned_copy(deepseek_path, tmp_path / "tuned")
    sizes = {p.name: p.stat().st_size for p in deepseek_path.glob("*.safetensors")}
    assert {p.name: p.stat().st_size for p in tuned.glob("*.safetensors")} == sizes
    (problem,) = model_mismatches(tuned, manifest)
    assert problem.startswith(f"{tuned}: weights_fingerprint ")
    assert f"!= the store's {manifest.weights_fingerprint[:12]}" in problem

    # A store of schema 2 recorded no fingerprint: only config and tokenizer can be compared.
    schema_2 = dataclasses.replace(manifest, schema_version=2, weights_fingerprint=None)
    assert model_mismatches(tuned, schema_2) == []
    (tuned / "config.json").write_text((tuned / "config.json").read_text() + "\n")
    assert [p.split(": ")[1].split()[0] for p in model_mismatches(tuned, schema_2)] == [
        "model_config_hash"
    ]


def test_a_large_weight_file_is_sampled_at_its_head_and_evenly_through_the_rest(
    tmp_path: Path,
) -> None:
    size = HEAD_BYTES + 64 * BLOCK_BYTES
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(bytes(size))
    before = weights_fingerprint(tmp_path)
    last_block = size - BLOCK_BYTES  # the 16th block ends the file
    for offset in (0, HEAD_BYTES - 1, HEAD_BYTES, last_block + BLOCK_BYTES - 1):
        with weights.open("r+b") as f:
            f.seek(offset)
            f.write(b"\x01")
        assert weights_fingerprint(tmp_path) != before, offset
        with weights.open("r+b") as f:
            f.seek(offset)
            f.write(b"\x00")
    assert weights_fingerprint(tmp_path) == before
    assert size - HEAD_BYTES > BLOCKS * BLOCK_BYTES  # sampled, not read whole


def test_a_model_directory_without_weights_is_named(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match=f"{tmp_path}: no weight files"):
        weights_fingerprint(tmp_path)
