"""The SpecForge and speculators exporters over a store written by the real shard writer: every
committed, written sample comes back bit for bit in the trainers' own layouts (keys, shapes,
dtypes, file names by global index; SpecForge's float32 -> bf16 cast rounds to nearest even),
nothing else is exported, an interrupted export resumes without redoing whole files, another
store's directory (or the same URL's, created again) is refused, and so is what a trainer cannot
train on (SpecForge with other than 3 aux layers, speculators without the pre-norm state). The
trainers' own loaders run on exports in tests/integration/test_trainers.py."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from actors.shard_writer import ShardWriter
from cluster.__main__ import main
from hsx_store.builder import create_store
from hsx_store.export.base import ExportConflict, ExportError
from hsx_store.export.files import exclusive
from hsx_store.export.run import export as export_as_asked
from hsx_store.export.run import read_exported, sample_path
from hsx_store.export.specforge import specforge_layers
from hsx_store.reader import HiddenStatesDataset, HiddenStatesIterable
from tests.helpers.exports import FORMATS, assert_same, bits, export, exported_files
from tests.helpers.synthetic import (
    LENGTHS,
    NUM_AUX,
    H,
    assert_sample_exact,
    finish_plan,
    manifest,
    new_store,
    partly_written_store,
    plan,
    planning_store,
    sample_bits,
)

PLANNED = len(plan()[0])


class Crash(Exception):
    """A kill, as seen by the code being interrupted."""


@pytest.fixture
def store_url(tmp_path: Path) -> tuple[str, list[int]]:
    _, visible = partly_written_store(tmp_path / "s.zarr")
    return str(tmp_path / "s.zarr"), visible


@pytest.mark.parametrize("fmt,dtype", [(f, d) for f in FORMATS for d in ("bfloat16", "float32")])
def test_every_visible_sample_round_trips_bit_for_bit_and_nothing_else_is_exported(
    tmp_path: Path, fmt: str, dtype: str
) -> None:
    _, visible = partly_written_store(tmp_path / "s.zarr", dtype)
    url, out = str(tmp_path / "s.zarr"), tmp_path / "out"
    lines: list[str] = []
    summary = export(url, out, fmt, say=lines.append)
    assert summary["exported"] == summary["files"] == len(visible) and summary["skipped"] == 0
    assert summary["bytes"] > 0 and lines
    # Files by global index: shard 1 (4..7, never committed) and sample 9 (failed) are absent.
    assert exported_files(out, fmt) == sorted(sample_path(out, fmt, i) for i in visible)
    doc = json.loads((out / "export.json").read_text())
    names = plan()[0]
    assert doc["exported"] == [[i, names[i]] for i in visible] and doc["format"] == fmt
    assert doc["manifest"]["layer_ids"] == [2, 4, 5] and doc["final_states"][0] == "post_norm"
    assert doc["hidden_dtype"] == ("bfloat16" if fmt == "specforge" else dtype)
    ds = HiddenStatesDataset(url)
    for k, i in enumerate(visible):
        want = ds[k]
        assert_same(read_exported(out, fmt, i), want, fmt)
        if fmt == "speculators" or dtype == "bfloat16":
            assert_sample_exact({**want, **read_exported(out, fmt, i)}, i, dtype)
    with pytest.raises(KeyError):
        read_exported(out, fmt, 9)


def test_specforge_files_are_what_its_generator_writes_and_its_loader_reads(
    tmp_path: Path, store_url: tuple[str, list[int]]
) -> None:
    url, visible = store_url
    out = tmp_path / "out"
    export(url, out, "specforge", say=lambda _: None)
    ds = HiddenStatesDataset(url)
    for k, i in enumerate(visible):
        path = out / "rows_0-2000" / f"data_{i}.ckpt"
        data = torch.load(path, map_location="cpu", weights_only=True)
        assert list(data) == ["input_ids", "loss_mask", "hidden_state", "aux_hidden_state"]
        t = len(ds[k]["input_ids"])
        shapes = {key: tuple(v.shape) for key, v in data.items()}
        assert shapes == {
            "input_ids": (t,),
            "loss_mask": (t,),
            "hidden_state": (1, t, H),
            "aux_hidden_state": (1, t, NUM_AUX * H),
        }
        assert data["input_ids"].dtype == data["loss_mask"].dtype == torch.int64
        assert data["hidden_state"].dtype == data["aux_hidden_state"].dtype == torch.bfloat16
        for v in data.values():  # each file holds its own sample, not the block it was read in
            assert v.untyped_storage().nbytes() == v.numel() * v.element_size()
        # OfflineEagle3Dataset.process_data: draft input and target after squeeze(0).
        want = ds[k]
        np.testing.assert_array_equal(
            bits(data["aux_hidden_state"].squeeze(0)), bits(want["aux_hidden_states"])
        )
        np.testing.assert_array_equal(
            bits(data["hidden_state"].squeeze(0)), bits(want["final_hidden_states"])
        )


def test_speculators_files_and_dataset_are_what_its_arrow_dataset_reads(
    tmp_path: Path, store_url: tuple[str, list[int]]
) -> None:
    import datasets

    url, visible = store_url
    out = tmp_path / "out"
    export(url, out, "speculators", say=lambda _: None)
    rows = datasets.load_from_disk(str(out))  # speculators: load_from_disk(--data-path)
    _, ids, masks = plan()
    assert len(rows) == PLANNED and list(rows.with_format(None)["seq_len"]) == [len(x) for x in ids]
    for i in range(PLANNED):  # every planned row, so that file index == row == global index
        assert torch.equal(rows[i]["input_ids"], torch.from_numpy(ids[i].astype(np.int64)))
        assert torch.equal(rows[i]["loss_mask"], torch.from_numpy(masks[i].astype(np.int64)))
    ds = HiddenStatesDataset(url)
    for k, i in enumerate(visible):
        path = out / "hidden_states" / f"hs_{i}.safetensors"
        with safe_open(path, "pt") as f:
            assert sorted(f.keys()) == ["hidden_states", "token_ids"]
        loaded = load_file(path)
        t = len(ids[i])
        assert loaded["hidden_states"].shape == (t, NUM_AUX + 1, H)
        assert loaded["hidden_states"].dtype == torch.bfloat16
        assert loaded["token_ids"].shape == (t,) and loaded["token_ids"].dtype == torch.int64
        # ArrowDataset._get_raw_data, step by step.
        assert torch.equal(loaded["token_ids"], rows[i]["input_ids"])
        want = ds[k]
        np.testing.assert_array_equal(
            bits(loaded["hidden_states"][:, :-1].flatten(1)), bits(want["aux_hidden_states"])
        )
        np.testing.assert_array_equal(
            bits(loaded["hidden_states"][:, -1]), bits(want["final_hidden_states"])
        )
        assert torch.equal(rows[i]["loss_mask"], want["loss_mask"])
    # token_freq.pt: speculators' {token id: count} over the loss-masked tokens of every row.
    freq = torch.load(out / "token_freq.pt", weights_only=True)
    want_freq: dict[int, int] = {}
    for row_ids, row_mask in zip(ids, masks, strict=True):
        for token in row_ids[row_mask.astype(bool)].tolist():
            want_freq[token] = want_freq.get(token, 0) + 1
    assert freq == want_freq and all(type(k) is int and type(v) is int for k, v in freq.items())


@pytest.mark.parametrize("fmt", FORMATS)
def test_an_interrupted_export_resumes_without_redoing_whole_files(
    tmp_path: Path, store_url: tuple[str, list[int]], fmt: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    url, visible = store_url
    out = tmp_path / "out"
    # A crash mid-export: the third rename fails. Only whole files are left, and export.json
    # already names the store.
    real_replace, samples_renamed = os.replace, []

    def crashing_replace(src, dst):
        if str(dst).endswith((".ckpt", ".safetensors")):
            samples_renamed.append(dst)
            if len(samples_renamed) == 3:
                raise Crash
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", crashing_replace)
    with pytest.raises(Crash):
        export(url, out, fmt, say=lambda _: None)
    monkeypatch.setattr(os, "replace", real_replace)
    assert len(exported_files(out, fmt)) == 2
    assert json.loads((out / "export.json").read_text())["exported"] == []
    assert not [p for p in out.rglob(".*tmp-*")]  # the failed write cleaned up after itself

    summary = export(url, out, fmt, say=lambda _: None)
    assert (summary["exported"], summary["skipped"]) == (len(visible) - 2, 2)

    # Delete two files and leave a stray temporary, as a killed run would: the re-run writes
    # exactly the missing two and touches nothing else.
    mtimes = {p: p.stat().st_mtime_ns for p in exported_files(out, fmt)}
    gone = [sample_path(out, fmt, i) for i in (visible[1], visible[-1])]
    for p in gone:
        p.unlink()
    stray = gone[0].parent / f".{gone[0].name}.tmp-999-0badcafe"
    stray.write_bytes(b"half a file")
    lines: list[str] = []
    summary = export(url, out, fmt, say=lines.append)
    assert (summary["exported"], summary["skipped"]) == (2, len(visible) - 2)
    assert summary["removed_temporaries"] == 1 and not stray.exists()
    assert any("temporary" in line for line in lines)
    for p, mtime in mtimes.items():
        if p not in gone:
            assert p.stat().st_mtime_ns == mtime, p
    ds = HiddenStatesDataset(url)
    for k, i in enumerate(visible):
        assert_same(read_exported(out, fmt, i), ds[k], fmt)

    # A finished export re-run writes nothing, and does not even read the hidden states.
    def no_reading(self):
        raise AssertionError("read the store")

    monkeypatch.setattr(HiddenStatesIterable, "__iter__", no_reading)
    summary = export(url, out, fmt, say=lambda _: None)
    assert (summary["exported"], summary["skipped"], summary["files"]) == (
        0,
        len(visible),
        len(visible),
    )


def test_a_directory_of_another_store_format_or_origin_is_refused(
    tmp_path: Path, store_url: tuple[str, list[int]]
) -> None:
    url, _ = store_url
    out = tmp_path / "out"
    export(url, out, "specforge", say=lambda _: None)
    before = sorted(out.rglob("*"))
    other = tmp_path / "other.zarr"
    new_store(other, "float32", {"name": "none"})  # another manifest (dtype) and URL
    with pytest.raises(ExportConflict, match=r"store_url .*manifest differs in .*dtype"):
        export(str(other), out, "specforge", say=lambda _: None)
    with pytest.raises(ExportConflict, match="format 'specforge' there, 'speculators' here"):
        export(url, out, "speculators", say=lambda _: None)
    assert sorted(out.rglob("*")) == before  # nothing written
    with pytest.raises(ExportError, match="a 'specforge' export"):
        read_exported(out, "speculators", 0)
    with exclusive(out), pytest.raises(ExportError, match="another export is writing"):
        export(url, out, "specforge", say=lambda _: None)
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "data_0.ckpt").write_bytes(b"someone else's")
    with pytest.raises(ExportError, match=r"has no export\.json"):
        export(url, foreign, "specforge", say=lambda _: None)


@pytest.mark.parametrize(
    "text,problem",
    [
        ("{not json", r"unreadable \(Expecting property name"),
        ("[1, 2]", r"not an export's record \(a list, not a mapping\)"),
        ('{"exported": {"0": "a"}}', r"`exported` must list .* found \{'0': 'a'\}"),
        ('{"exported": [[0, "a"], ["1", "b"]]}', r"`exported` must list .* found \['1', 'b'\]"),
    ],
)
def test_a_damaged_export_json_is_named_by_export_and_by_readers(
    tmp_path: Path, store_url: tuple[str, list[int]], text: str, problem: str
) -> None:
    url, _ = store_url
    out = tmp_path / "out"
    export(url, out, "specforge", say=lambda _: None)
    (out / "export.json").write_text(text)
    with pytest.raises(ExportConflict, match=rf"export\.json: {problem}.*refusing to write"):
        export(url, out, "specforge", say=lambda _: None)
    with pytest.raises(ExportError, match=rf"export\.json: {problem}"):
        read_exported(out, "specforge", 0)


def test_a_store_whose_sample_ids_repeat_is_refused_before_anything_is_written(
    tmp_path: Path, store_url: tuple[str, list[int]]
) -> None:
    """Plans made before ids holding a NUL were refused could store "a" twice ("a" and "a" +
    NUL): the export finds each sample's index by its id and would write one sample's rows
    under the other's name."""
    import zarr

    url, _ = store_url
    ids = zarr.open_group(url, mode="r+")["sample_id"]
    ids[3] = ids[1]
    with pytest.raises(ExportError, match=r"sample id 's1-é' is stored for samples 1 and 3"):
        export(url, tmp_path / "out", "specforge", say=lambda _: None)
    assert not (tmp_path / "out").exists()


def test_cli_exits_0_on_success_1_on_errors_2_without_a_store(
    tmp_path: Path, store_url: tuple[str, list[int]], capsys: pytest.CaptureFixture
) -> None:
    url, visible = store_url
    out = tmp_path / "out"
    assert main(["export", "--store", url, "--format", "specforge", "--out", str(out)]) == 0
    assert len(exported_files(out, "specforge")) == len(visible)
    assert "samples written" in capsys.readouterr().out
    speculators = ["export", "--store", url, "--format", "speculators", "--out", str(out)]
    assert main(speculators) == 1
    assert "--allow-post-norm" in capsys.readouterr().err  # this store has no pre-norm state
    assert main([*speculators, "--allow-post-norm"]) == 1
    assert "another store or format" in capsys.readouterr().err
    missing = str(tmp_path / "missing.zarr")
    assert main(["export", "--store", missing, "--format", "specforge", "--out", str(out)]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_cli_exits_2_naming_a_store_whose_zarr_json_is_damaged(
    tmp_path: Path, store_url: tuple[str, list[int]], capsys: pytest.CaptureFixture
) -> None:
    url, _ = store_url
    (Path(url) / "zarr.json").write_text('{"attributes": ')
    out = tmp_path / "out"
    assert main(["export", "--store", url, "--format", "specforge", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"{url}/zarr.json is damaged: zarr cannot read it" in err and not out.exists()


def test_specforge_layer_ids_follow_the_model_family(deepseek_path: Path, llama_path: Path) -> None:
    """SpecForge is told the ids SGLang is asked for: Llama adds 1, DeepSeek takes them as given."""
    from hsx_store.format import make_manifest
    from hsx_store.layers import expected_capture

    for path, requested in ((deepseek_path, [0, 1, 3]), (llama_path, [0, 3, 6])):
        capture = expected_capture(path, requested, "bfloat16")
        manifest = make_manifest(str(path), path, capture, max_length=64, samples_per_shard=2)
        assert specforge_layers(manifest) == requested
    assert capture["layer_ids"] == [1, 4, 7]  # Llama: HF indices one above the requested ids


def test_specforge_casts_float32_to_bf16_rounding_to_nearest_even(tmp_path: Path) -> None:
    """Ties go to the even bf16 neighbour; truncation or rounding half up would differ."""
    store = new_store(tmp_path / "s.zarr", "float32", {"name": "none"})
    writer = ShardWriter(store, store.shards[0])
    one_and = [1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 1 + 2**-8 + 2**-20, 1.0]
    want = [1.0, 1 + 2**-6, -1.0, 1 + 2**-7, 1.0]  # bf16 keeps 7 fraction bits
    for i in range(store.shards[0].sample_begin, store.shards[0].sample_end):
        aux, final = sample_bits(i, "float32")
        final.reshape(-1)[: len(one_and)] = one_and
        writer.write_sample(i, aux, final)
    writer.commit({"worker": "w0"})
    export(str(tmp_path / "s.zarr"), tmp_path / "out", "specforge", say=lambda _: None)
    got = read_exported(tmp_path / "out", "specforge", 0)["final_hidden_states"]
    assert got.dtype == torch.bfloat16 and got.reshape(-1)[:5].tolist() == want


def test_what_a_trainer_cannot_train_on_is_refused_before_anything_is_written(
    tmp_path: Path, store_url: tuple[str, list[int]]
) -> None:
    url, _ = store_url
    out = tmp_path / "out"
    with pytest.raises(ExportError, match=r"no pre-norm final state.*--allow-post-norm"):
        export_as_asked(url, out, "speculators", say=lambda _: None)
    assert not out.exists()
    # Five aux layers: speculators takes any number, SpecForge exactly three.
    five = dataclasses.replace(manifest(), num_aux=5, layer_ids=[1, 2, 3, 5, 6])
    store = create_store(tmp_path / "five.zarr", five, *plan())
    writer = ShardWriter(store, store.shards[0])
    rng = np.random.default_rng(5)
    rows = {}
    for i in range(store.shards[0].sample_begin, store.shards[0].sample_end):
        n = len(plan()[1][i])
        rows[i] = rng.integers(0, 1 << 15, (n, 6, H), dtype=np.uint16)  # finite bf16 bits
        writer.write_sample(
            i, rows[i][:, :5].view(ml_dtypes.bfloat16), rows[i][:, 5].view(ml_dtypes.bfloat16)
        )
    writer.commit({"worker": "w0"})
    with pytest.raises(ExportError, match=r"5 aux layers .* exactly 3"):
        export(str(tmp_path / "five.zarr"), out, "specforge", say=lambda _: None)
    assert not out.exists()
    export(str(tmp_path / "five.zarr"), out, "speculators", say=lambda _: None)
    doc = json.loads((out / "export.json").read_text())
    assert doc["speculators_command"].endswith("--target-layer-ids 1 2 3 5 6")
    for i, want in rows.items():
        hidden = load_file(sample_path(out, "speculators", i))["hidden_states"]
        assert hidden.shape == (len(want), 6, H)
        np.testing.assert_array_equal(bits(hidden).view(np.uint16), want)


def test_an_export_of_a_store_since_created_again_at_the_same_url_is_refused(
    tmp_path: Path,
) -> None:
    url, out = str(tmp_path / "s.zarr"), tmp_path / "out"
    partly_written_store(url)
    export(url, out, "specforge", say=lambda _: None)
    shutil.rmtree(url)
    partly_written_store(url)  # the same URL, manifest, job and samples: another store
    with pytest.raises(ExportConflict, match=r"store_id '[0-9a-f]{32}' there, '[0-9a-f]{32}' here"):
        export(url, out, "specforge", say=lambda _: None)
    assert export(url, tmp_path / "fresh", "specforge", say=lambda _: None)["files"] == 6


def test_a_store_still_being_planned_is_refused_and_an_earlier_partial_export_is_completed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The speculators dataset (and token_freq.pt) has a row per planned sample. Before: an
    export made after 2 of 3 shards were planned kept its 8-row dataset for good, while a later
    export added the files of every sample (speculators never reads past the dataset)."""
    import datasets

    from hsx_store.format import Store

    names, _, masks = plan()
    url, out = tmp_path / "s.zarr", tmp_path / "spec"
    builder = planning_store(url)  # shards 0 and 1 planned, shard 2 not yet
    with pytest.raises(ExportError, match=r"still being planned \(8 samples so far\)"):
        export(str(url), out, "speculators", say=lambda _: None)
    assert not out.exists()

    # What the export did before it refused: a dataset of the 8 samples planned so far.
    opened = Store.open

    def planned_so_far(*args, **kwargs) -> Store:
        store = opened(*args, **kwargs)
        store.planned = True
        return store

    monkeypatch.setattr(Store, "open", planned_so_far)
    export(str(url), out, "speculators", say=lambda _: None)
    monkeypatch.undo()
    assert len(datasets.load_from_disk(str(out))) == 8

    finish_plan(builder)
    export(str(url), out, "speculators", say=lambda _: None)
    dataset = datasets.load_from_disk(str(out))
    assert len(dataset) == len(names) == PLANNED
    assert [len(row) for row in dataset["input_ids"]] == LENGTHS
    freq = torch.load(out / "token_freq.pt", weights_only=True)
    assert sum(freq.values()) == sum(int(m.sum()) for m in masks)
    assert json.loads((out / "export.json").read_text())["num_planned_samples"] == PLANNED
