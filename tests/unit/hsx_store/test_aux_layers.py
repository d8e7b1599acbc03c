"""1 and 8 aux layers through the store, the readers, verify and the speculators export, bit
for bit (EAGLE-3 uses 3, DFlash-style drafters 5 or more)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from actors.config import MAX_AUX_LAYERS
from actors.shard_writer import ShardWriter
from hsx_store.builder import create_store
from hsx_store.export.run import export, read_exported, sample_path
from hsx_store.format import Store
from hsx_store.integrity import verify_store
from hsx_store.reader import HiddenStatesDataset
from tests.helpers.synthetic import manifest as store_manifest

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
