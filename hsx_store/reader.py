"""PyTorch readers of a store, for drafter training: only committed, written samples are seen.

    ds = HiddenStatesDataset("out/demo/demo.zarr")            # random access
    ds[0]["aux_hidden_states"]                                 # bf16 [T, num_aux * H]
    it = HiddenStatesIterable(url, rank=rank, world_size=ws)   # sequential, shard-aware
    DataLoader(it, batch_size=None, num_workers=4)

A sample is a dict of `sample_id`, `input_ids`, `loss_mask`, `aux_hidden_states`,
`final_hidden_states` and, where the store keeps it, `prenorm_hidden_states`; FP8 stores read as
bf16 unless `fp8="raw"`. The visible samples are a snapshot taken when the reader is built. The
store is opened lazily in each process (on object storage: not in a forked worker). Chunks are
read ahead of the consumer: local files by hsx_store/file_rows.py, remote objects by
hsx_store/object_rows.py.

Every key, shape and dtype: docs/using-the-data.md.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Literal

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info

from hsx_store import file_rows, object_rows
from hsx_store.file_rows import FileRows
from hsx_store.format import STATUS_WRITTEN, Manifest, Shard, Store, stored_arrays
from hsx_store.fp8 import FP8_DTYPE, as_float8, dequantize, scale_name
from hsx_store.location import is_remote
from hsx_store.object_rows import RemoteRows
from hsx_store.read_ahead import Block

Sample = dict[str, Any]
Fp8Mode = Literal["dequantize", "raw"]
PLAN_ARRAYS = ("input_ids", "loss_mask")


def token_arrays(manifest: Manifest) -> list[str]:
    """The store's token-major arrays: the plan's, the hidden ones and an FP8 store's scales."""
    return [*PLAN_ARRAYS, *(a.name for a in stored_arrays(manifest))]


class _StoreView:
    """What both readers share: the visible samples and a per-process store handle."""

    def __init__(
        self,
        url: str,
        storage_options: Mapping[str, Any] | None,
        concurrency: int | None = None,
        prefetch_bytes: int | None = None,
        fp8: Fp8Mode = "dequantize",
    ) -> None:
        if fp8 not in ("dequantize", "raw"):
            raise ValueError(f"fp8 must be 'dequantize' or 'raw', got {fp8!r}")
        self.url, self.storage_options = str(url), storage_options
        self.concurrency, self.prefetch_bytes, self.fp8 = concurrency, prefetch_bytes, fp8
        store = Store.open(self.url, storage_options=storage_options)
        self.manifest: Manifest = store.manifest
        self.token_arrays = token_arrays(self.manifest)
        committed = store.committed()
        status = np.asarray(store.group["sample_status"][:])
        self.shards: list[Shard] = [sh for sh in store.shards if committed[sh.index]]
        self.visible = np.array(
            [
                i
                for sh in self.shards
                for i in range(sh.sample_begin, sh.sample_end)
                if status[i] == STATUS_WRITTEN
            ],
            dtype=np.int64,
        )
        self.sample_start, self.sample_length = store.sample_start, store.sample_length
        self.sample_ids = np.asarray(store.group["sample_id"][:])
        self._store: Store | None = store
        self._opened_by = os.getpid()
        self._rows: FileRows | RemoteRows | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_store": None, "_rows": None}  # per process

    @property
    def store(self) -> Store:
        if self._store is not None and self._opened_by != os.getpid():  # a forked copy
            if is_remote(self.url):
                raise RuntimeError(
                    f"{self.url}: object storage cannot be read in a forked process (its client "
                    "runtime does not survive fork): give the DataLoader "
                    "multiprocessing_context='spawn' (or 'forkserver')"
                )
            self._store, self._rows = None, None  # its read threads stayed in the parent
        if self._store is None:
            self._store = Store.open(self.url, storage_options=self.storage_options)
            self._opened_by = os.getpid()
        return self._store

    @property
    def rows(self) -> FileRows | RemoteRows:
        """The store's row reader, made once per process (array handles read metadata)."""
        store = self.store  # first: refuses a forked copy of a remote store
        if self._rows is None:
            arrays = {name: store.group[name] for name in self.token_arrays}
            if is_remote(self.url):
                self._rows = RemoteRows(
                    arrays,
                    _default(self.concurrency, object_rows.CONCURRENCY),
                    _default(self.prefetch_bytes, object_rows.PREFETCH_BYTES),
                )
            else:
                self._rows = FileRows(
                    arrays,
                    _default(self.concurrency, file_rows.READ_THREADS),
                    _default(self.prefetch_bytes, file_rows.PREFETCH_BYTES),
                )
        return self._rows

    def read_rows(self, begin: int, end: int) -> dict[str, np.ndarray]:
        """Rows [begin, end) of every token-major array, their chunks read at once."""
        return self.rows.read(begin, end)

    def read_blocks(self, blocks: Iterable[Block]) -> Iterator[tuple[Block, dict[str, np.ndarray]]]:
        """Each block with its rows, in order, read ahead of the caller."""
        return self.rows.blocks(blocks)

    def sample(self, i: int, rows: dict[str, np.ndarray], offset: int) -> Sample:
        """Sample i out of rows read from `offset` on."""
        a = int(self.sample_start[i]) - offset
        b = a + int(self.sample_length[i])
        sample = {
            "sample_id": str(self.sample_ids[i]),
            "input_ids": torch.from_numpy(rows["input_ids"][a:b].astype(np.int64)),
            "loss_mask": torch.from_numpy(rows["loss_mask"][a:b].astype(np.int64)),
        }
        for name in self.manifest.hidden_arrays:
            sample.update(self._hidden(name, rows, slice(a, b)))
        return sample

    def _hidden(self, name: str, rows: dict[str, np.ndarray], at: slice) -> dict[str, Any]:
        """Hidden array `name`'s entries of a sample: aux flattened to [T, num_aux * H]."""
        x = np.ascontiguousarray(rows[name][at])
        if self.manifest.dtype == FP8_DTYPE:
            scale = np.ascontiguousarray(rows[scale_name(name)][at])
            if self.fp8 == "raw":
                return {name: as_float8(x), scale_name(name): torch.from_numpy(scale)}
            value = dequantize(x, scale)
        elif self.manifest.dtype == "bfloat16":  # stored bits, viewed, never converted
            value = torch.from_numpy(x.view(np.int16)).view(torch.bfloat16)
        else:
            value = torch.from_numpy(x)
        return {name: value.reshape(len(value), -1) if value.ndim == 3 else value}


def _default(value: int | None, default: int) -> int:
    return default if value is None else value


class _VisibleSamples:
    """What both readers show of their store view."""

    _view: _StoreView

    @property
    def manifest(self) -> Manifest:
        return self._view.manifest

    @property
    def sample_indices(self) -> np.ndarray:
        """Store indices of the visible samples, ascending (item k of the Dataset is the k-th)."""
        return self._view.visible

    def __len__(self) -> int:  # for the iterable: across all consumers
        return len(self._view.visible)


class HiddenStatesDataset(_VisibleSamples, Dataset):
    """Random access: item k is the k-th visible sample, in store (= plan) order."""

    def __init__(
        self,
        url: str,
        storage_options: Mapping[str, Any] | None = None,
        fp8: Fp8Mode = "dequantize",
    ) -> None:
        self._view = _StoreView(url, storage_options, fp8=fp8)

    def __getitem__(self, k: int) -> Sample:
        if not -len(self) <= k < len(self):
            raise IndexError(f"sample {k} out of range for {len(self)} visible samples")
        i = int(self._view.visible[k])
        start, length = int(self._view.sample_start[i]), int(self._view.sample_length[i])
        rows = self._view.read_rows(start, start + length)
        return self._view.sample(i, rows, start)


class HiddenStatesIterable(_VisibleSamples, IterableDataset):
    """Sequential and shard-aware: committed shards are dealt round-robin to the consumers
    (`world_size` ranks x DataLoader workers each), so every visible sample is yielded exactly
    once per epoch across them. Each shard is read in contiguous blocks of whole samples of at
    most `block_bytes` (one read per array per block; a larger sample is a block of its own),
    so memory stays bounded; 16 MB blocks read fastest here (malloc reuses their memory, where
    larger ones are mapped afresh and page-faulted in). `shuffle`
    permutes the shard order per `epoch` (same on every rank: set `epoch` before each one).

    The next blocks are read while the consumer works on the current one, at most
    `concurrency` reads in flight and about `prefetch_bytes` ahead (at least the next block).
    Defaults: local files 8 reads and 128 MB (hsx_store/file_rows.py); object storage 8 GETs and
    256 MB of whole chunk objects, each fetched once (hsx_store/object_rows.py)."""

    def __init__(
        self,
        url: str,
        *,
        rank: int | None = None,
        world_size: int | None = None,
        shuffle: bool = False,
        seed: int = 0,
        block_bytes: int = 16 << 20,
        storage_options: Mapping[str, Any] | None = None,
        concurrency: int | None = None,
        prefetch_bytes: int | None = None,
        fp8: Fp8Mode = "dequantize",
    ) -> None:
        self._view = _StoreView(url, storage_options, concurrency, prefetch_bytes, fp8)
        self.rank, self.world_size = rank, world_size
        self.shuffle, self.seed, self.epoch = shuffle, seed, 0
        self.block_bytes = block_bytes

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _consumer(self) -> tuple[int, int]:
        rank, world = self.rank, self.world_size
        if rank is None or world is None:
            dist = torch.distributed
            on = dist.is_available() and dist.is_initialized()
            rank, world = (dist.get_rank(), dist.get_world_size()) if on else (0, 1)
        info = get_worker_info()
        workers, worker = (info.num_workers, info.id) if info else (1, 0)
        return rank * workers + worker, world * workers

    def __iter__(self) -> Iterator[Sample]:
        me, consumers = self._consumer()
        order = np.arange(len(self._view.shards))
        if self.shuffle:
            order = np.random.default_rng((self.seed, self.epoch)).permutation(order)
        visible = set(self._view.visible.tolist())
        shards = (self._view.shards[int(k)] for k in order[me::consumers])
        blocks = (
            block
            for shard in shards
            for block in self._blocks(shard)
            if any(n in visible for n in range(*block.tag))  # not only failed samples
        )
        for block, rows in self._view.read_blocks(blocks):
            first, stop = block.tag
            for n in range(first, stop):
                if n in visible:
                    yield self._view.sample(n, rows, block.begin)
            del rows  # its buffers are free once the consumer lets go of the samples

    def _blocks(self, shard: Shard) -> Iterator[Block]:
        """The shard's blocks: rows of samples [first, stop) as `tag`, grown by whole samples
        while they fit in block_bytes (at least one sample)."""
        v, m = self._view, self._view.manifest
        row_bytes = sum(a.row_bytes for a in stored_arrays(m))
        i = shard.sample_begin
        while i < shard.sample_end:
            begin = int(v.sample_start[i])
            j = i + 1
            while (
                j < shard.sample_end
                and (int(v.sample_start[j] + v.sample_length[j]) - begin) * row_bytes
                <= self.block_bytes
            ):
                j += 1
            end = int(v.sample_start[j - 1] + v.sample_length[j - 1])
            yield Block(begin, end, (i, j))
            i = j
