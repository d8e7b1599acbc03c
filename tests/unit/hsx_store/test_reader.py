"""The training readers over a store written by the real shard writer: stored bits and plan
come back exactly, only committed and written samples are visible, DataLoader workers and ranks
split the samples exactly once."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
import torch
import zarr
from obstore.store import LocalStore as ObstoreLocal
from torch.utils.data import DataLoader
from zarr.storage import ObjectStore

from hsx_store.buffers import RecycledBuffers
from hsx_store.file_rows import FileRows
from hsx_store.format import StoreFormatError
from hsx_store.object_rows import RemoteRows
from hsx_store.read_ahead import Block, Rows
from hsx_store.reader import HiddenStatesDataset, HiddenStatesIterable, token_arrays
from hsx_store.row_source import RowSource
from tests.helpers.synthetic import assert_sample_exact, partly_written_store, plan


@pytest.mark.parametrize(
    "dtype,codec", [("bfloat16", "none"), ("bfloat16", "zstd"), ("float32", "none")]
)
def test_random_access_returns_the_stored_bits_of_visible_samples_only(
    tmp_path: Path, dtype: str, codec: str
) -> None:
    _, visible = partly_written_store(tmp_path / "s.zarr", dtype, codec)
    ds = HiddenStatesDataset(str(tmp_path / "s.zarr"))
    assert len(ds) == len(visible)
    for k, i in enumerate(visible):
        assert_sample_exact(ds[k], i, dtype)
    with pytest.raises(IndexError):
        ds[len(visible)]


@pytest.mark.parametrize(
    "block_bytes,codec", [(1, "none"), (1 << 30, "none"), (1000, "zstd")]
)  # one sample per read, whole shards, a few samples
def test_dataloader_workers_and_ranks_see_every_visible_sample_once(
    tmp_path: Path, block_bytes: int, codec: str
) -> None:
    _, visible = partly_written_store(tmp_path / "s.zarr", codec=codec)
    names = plan()[0]
    url = str(tmp_path / "s.zarr")
    seen = []
    for rank in range(2):
        it = HiddenStatesIterable(url, rank=rank, world_size=2, block_bytes=block_bytes)
        loader = DataLoader(it, batch_size=None, num_workers=2)
        for sample in loader:
            i = names.index(sample["sample_id"])
            assert_sample_exact(sample, i, "bfloat16")
            seen.append(i)
    assert sorted(seen) == visible


def test_shuffled_epochs_permute_shards_and_still_cover_everything(tmp_path: Path) -> None:
    _, visible = partly_written_store(tmp_path / "s.zarr")
    it = HiddenStatesIterable(str(tmp_path / "s.zarr"), shuffle=True, seed=3)
    orders = []
    for epoch in range(6):
        it.set_epoch(epoch)
        orders.append([s["sample_id"] for s in it])
    assert all(sorted(o) == sorted(orders[0]) for o in orders) and len(orders[0]) == len(visible)
    assert len({tuple(o) for o in orders}) > 1


def test_a_store_of_unknown_schema_is_refused(tmp_path: Path) -> None:
    store, _ = partly_written_store(tmp_path / "s.zarr")
    manifest = dict(store.group.attrs["manifest"])
    store.group.attrs["manifest"] = {**manifest, "schema_version": 99}
    with pytest.raises(StoreFormatError, match="schema version 99 is not supported"):
        HiddenStatesDataset(str(tmp_path / "s.zarr"))
    with pytest.raises(StoreFormatError):
        HiddenStatesIterable(str(tmp_path / "s.zarr"))


@pytest.mark.parametrize("codec", ["none", "zstd"])
def test_file_reads_equal_zarr_reads_in_any_blocks_missing_chunks_included(
    tmp_path: Path, codec: str
) -> None:
    store, _ = partly_written_store(tmp_path / "s.zarr", codec=codec)
    (tmp_path / "s.zarr" / "aux_hidden_states" / "c" / "1" / "0" / "0").unlink()
    arrays = {name: store.group[name] for name in token_arrays(store.manifest)}
    total = arrays["aux_hidden_states"].shape[0]
    rng = np.random.default_rng(0)
    cuts = sorted({0, total, *rng.integers(1, total, 12).tolist()})
    blocks = [Block(a, b, tag=k) for k, (a, b) in enumerate(itertools.pairwise(cuts))]
    for threads, prefetch in ((1, 0), (4, 0), (4, 1 << 30), (3, 100)):
        rows = FileRows(arrays, threads, prefetch)
        assert all(s.direct == (codec == "none") for s in rows.sources.values())
        got = list(rows.blocks(blocks))
        assert [block for block, _ in got] == blocks  # in order, tags handed back
        for block, read in got:
            for name, array in arrays.items():
                np.testing.assert_array_equal(read[name], array[block.begin : block.end])
                np.testing.assert_array_equal(
                    rows.read(block.begin, block.end)[name], array[block.begin : block.end]
                )


def test_a_chunk_file_cut_short_fails_the_read_naming_it(tmp_path: Path) -> None:
    partly_written_store(tmp_path / "s.zarr")
    chunk = tmp_path / "s.zarr" / "final_hidden_states" / "c" / "1" / "0"
    chunk.write_bytes(chunk.read_bytes()[:100])
    reader = iter(HiddenStatesIterable(str(tmp_path / "s.zarr"), block_bytes=1))
    with pytest.raises(OSError, match="final_hidden_states/c/1/0: chunk file shorter"):
        list(reader)


def test_read_buffers_are_reused_only_once_no_sample_holds_them(tmp_path: Path) -> None:
    pool = RecycledBuffers()
    first = pool.take((5, 3), np.dtype(np.uint16))
    held = torch.from_numpy(first[1:3].view(np.int16))  # a sample viewing the buffer
    second = pool.take((4, 3), np.dtype(np.uint16))
    assert not np.shares_memory(first, second)
    del first, second
    assert not np.shares_memory(pool.take((4, 3), np.dtype(np.uint16)), held.numpy())
    del held
    again = pool.take((8, 3), np.dtype(np.uint16))  # room for 8 rows: the first buffer
    assert any(np.shares_memory(again, b) for b in pool._buffers[:1])
    assert again.ctypes.data % 4096 == 0  # the kernel's copy is 4x slower 16 bytes past a page
    # Samples kept while the reader goes on keep their own bits.
    _, visible = partly_written_store(tmp_path / "s.zarr")
    kept = list(HiddenStatesIterable(str(tmp_path / "s.zarr"), block_bytes=1))
    names = plan()[0]
    for sample in kept:
        assert_sample_exact(sample, names.index(sample["sample_id"]), "bfloat16")
    assert len(kept) == len(visible)


def _read_through(source: RowSource, blocks: list[Block]) -> list[tuple[Block, Rows]]:
    """What the reader does with a backend, knowing only the contract."""
    return [
        (block, {k: v.copy() for k, v in rows.items()}) for block, rows in source.blocks(blocks)
    ]


def test_both_row_backends_are_row_sources_and_read_the_same_rows(tmp_path: Path) -> None:
    """The local directory's backend and object storage's (here over obstore's local-directory
    store, so its raw-GET path runs) serve one store's rows alike through the RowSource
    contract the reader types against."""
    store, _ = partly_written_store(tmp_path / "s.zarr")
    names = token_arrays(store.manifest)
    local = {name: store.group[name] for name in names}
    remote_group = zarr.open_group(ObjectStore(ObstoreLocal(tmp_path / "s.zarr")), mode="r")
    remote = {name: remote_group[name] for name in names}
    total = local["aux_hidden_states"].shape[0]
    blocks = [Block(0, 3), Block(3, total // 2), Block(total // 2, total)]
    backends: list[RowSource] = [FileRows(local), RemoteRows(remote)]
    assert all(isinstance(b, RowSource) for b in backends)
    assert all(s.raw for s in backends[1].sources.values())  # plain GETs, not zarr's reads
    expected = [(block, {n: local[n][block.begin : block.end] for n in names}) for block in blocks]
    for backend in backends:
        got = _read_through(backend, blocks)
        assert [block for block, _ in got] == blocks
        for (_, rows), (_, want) in zip(got, expected, strict=True):
            for name in names:
                np.testing.assert_array_equal(rows[name], want[name])
        np.testing.assert_array_equal(backend.read(2, 9)["input_ids"], local["input_ids"][2:9])
