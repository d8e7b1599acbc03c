"""PyTorch readers of a store, for drafter training: only committed, written samples are seen.

    ds = HiddenStatesDataset("out/demo/demo.zarr")            # random access
    ds[0]["aux_hidden_states"]                                 # bf16 [T, num_aux * H]
    it = HiddenStatesIterable(url, rank=rank, world_size=ws)   # sequential, shard-aware
    DataLoader(it, batch_size=None, num_workers=4)

A sample is a dict of `sample_id`, `input_ids`, `loss_mask`, `aux_hidden_states`,
`final_hidden_states` and, where the store keeps it, `prenorm_hidden_states`; FP8 stores read as
bf16 unless `fp8="raw"`. A store of images adds `image_spans`, `image_grid_thw`, `images` (the
encoded bytes, checked against their digests) and `image_digests`, and an M-RoPE one
`position_ids`. The visible samples are a snapshot taken when the reader is built. The
store is opened lazily in each process (on object storage: not in a forked worker). Chunks are
read ahead of the consumer: local files by hsx_store/file_rows.py, remote objects by
hsx_store/object_rows.py. A reader is bound to the store it was built on (its `store_id`): rows
read are handed out only once the store is confirmed still there after their read (`confirm`),
so one that finds another store at its URL raises `StoreReplaced` rather than yield its rows.

Every key, shape and dtype: docs/using-the-data.md.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, Literal

import numpy as np
import obstore
import obstore.exceptions
import torch
import zarr
from torch.utils.data import Dataset, IterableDataset, get_worker_info
from zarr.abc.store import Store as ZarrStore
from zarr.storage import LocalStore, ObjectStore

from hsx_store import file_rows, object_rows
from hsx_store.file_rows import FileRows
from hsx_store.format import STATUS_WRITTEN, Manifest, Shard, Store, plan_arrays, stored_arrays
from hsx_store.fp8 import FP8_DTYPE, as_float8, dequantize, scale_name
from hsx_store.images import ImageBlobs, SampleImage
from hsx_store.location import StoreAccessError, is_remote
from hsx_store.object_rows import RemoteRows
from hsx_store.read_ahead import Block
from hsx_store.row_source import RowSource

Sample = dict[str, Any]
Fp8Mode = Literal["dequantize", "raw"]
log = logging.getLogger(__name__)
COMPLETE = "the job is complete: every planned shard is committed"  # why following ended
PLAN_ARRAYS = ("input_ids", "loss_mask")  # a text store's (plan_arrays: an M-RoPE store's too)
IMAGE_CACHE_BYTES = 64 << 20  # encoded images kept per process: a sample's images often recur


class StoreReplaced(StoreAccessError):
    """The store a reader was built on is no longer at its URL: another store (another
    `store_id`) is there now, or none. Its layout would misplace every row of the new one."""


def _describe(store_id: str | None) -> str:
    return "none (a store made before store ids)" if store_id is None else store_id


def _replaced(url: str, bound: str | None, now: str) -> StoreReplaced:
    """The error for a reader (or export) bound to store_id `bound` at `url`, which holds
    `now` ("store_id ... there now", "no store there now")."""
    return StoreReplaced(
        f"{url}: store_id {_describe(bound)} when first read, {now}: the store was "
        "deleted or made again at this URL, and the layout read from the first one would "
        "misplace the rows of this one. Start again on the new store (a cursor or an export "
        "made from the old one does not apply to it)"
    )


def check_same_store(
    url: str, bound: str | None, found: str | None, cause: BaseException | None = None
) -> None:
    """Raises StoreReplaced unless `found`, the store_id at `url` now, is `bound`."""
    if found != bound:
        error = _replaced(url, bound, f"store_id {_describe(found)} there now")
        raise error from cause


def bound_attributes(
    url: str, location: ZarrStore, bound: str | None, cause: BaseException | None = None
) -> dict[str, Any]:
    """The attributes of the store at `url` (`location`), read afresh: one small read, its
    `zarr.json`. StoreReplaced unless it is still store `bound` (`cause`: the error that made
    the caller look)."""
    try:
        group = zarr.open_group(store=location, mode="r", zarr_format=3)
    except (FileNotFoundError, zarr.errors.GroupNotFoundError):
        raise _replaced(url, bound, "no store there now") from cause
    attrs = group.attrs.asdict()
    check_same_store(url, bound, attrs.get("store_id"), cause)
    return attrs


Fingerprint = tuple[Any, ...] | None


def fingerprint(location: ZarrStore) -> Fingerprint:
    """What changes whenever the store's `zarr.json` is written, without reading it: a local
    file's inode, mtime and size (zarr writes it to a new file and renames that over it), an
    object's ETag (a hash of its bytes) and size, by one HEAD. None: no zarr.json there."""
    try:
        if isinstance(location, LocalStore):
            st = (Path(location.root) / "zarr.json").stat()
            return st.st_ino, st.st_mtime_ns, st.st_size
        if isinstance(location, ObjectStore):
            meta = obstore.head(location.store, "zarr.json")
            return meta["e_tag"], meta["size"]
    except (FileNotFoundError, obstore.exceptions.NotFoundError):
        return None
    raise TypeError(f"no fingerprint of a {type(location).__name__}")


def token_arrays(manifest: Manifest) -> list[str]:
    """The store's token-major arrays: the plan's, the hidden ones and an FP8 store's scales."""
    return [*plan_arrays(manifest), *(a.name for a in stored_arrays(manifest))]


class _StoreView:
    """What both readers share: the committed shards seen so far, their samples' ids and
    status, and a per-process store handle. `refresh()` catches up with later commits. Bound
    to the store it opened first (`store_id`): every handle opened later, every refresh, and
    every read before its rows are handed out (`confirm`) checks that the URL still holds it."""

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
        self.store_id: str | None = store.group.attrs.get("store_id")
        self.last_report: dict[str, Any] | None = None  # as the last refresh read it
        self._confirmed: Fingerprint = None  # zarr.json's, before its last read found store_id
        self.manifest: Manifest = store.manifest
        self.token_arrays = token_arrays(self.manifest)
        self._store: Store | None = store
        self._opened_by = os.getpid()
        self._rows: RowSource | None = None
        self.shards: list[Shard] = []  # committed, in the order this view saw them commit
        self.seen: set[int] = set()  # their indices
        self.sample_ids = np.zeros(0, dtype=object)
        self.written = np.zeros(0, dtype=bool)  # per sample: in a committed shard, and written
        self.images: dict[int, list[SampleImage]] = {}  # image stores: those of the shards seen
        self._blobs: ImageBlobs | None = None  # per process, like the store handle
        self._blob_cache: OrderedDict[str, bytes] = OrderedDict()
        self.refresh()

    def refresh(self) -> list[Shard]:
        """The shards committed since this view last looked (the plan may have grown too):
        their samples' ids and status read once, when their commit is first seen. A shard
        commits once (its first claim wins), so no shard is seen twice. The store's attributes
        are read after the commits, ids and status: a store made at this URL since writes its
        `store_id` before any commit, so none of its commits is ever taken for this one's."""
        store = self.store
        try:
            store.refresh()
            committed = store.committed()
            new = [sh for sh in store.shards if committed[sh.index] and sh.index not in self.seen]
            if new:
                begin, end = min(sh.sample_begin for sh in new), max(sh.sample_end for sh in new)
                ids = np.asarray(store.array("sample_id")[begin:end])
                status = np.asarray(store.array("sample_status")[begin:end])
                images = store.sample_images(begin, end)  # {} for a text store: no read
        except Exception as exc:  # another store's arrays misread: say that, if so
            self.check(cause=exc)
            raise
        self.check()
        self.sample_start, self.sample_length = store.sample_start, store.sample_length
        if not new:
            return []
        grow = store.num_samples - len(self.written)
        if grow and self._rows is not None:  # the plan grew, its arrays too: handles afresh
            self._rows = None
        self.sample_ids = np.concatenate([self.sample_ids, np.full(grow, "", dtype=object)])
        self.written = np.concatenate([self.written, np.zeros(grow, dtype=bool)])
        for sh in new:
            at, of = (
                slice(sh.sample_begin, sh.sample_end),
                slice(sh.sample_begin - begin, sh.sample_end - begin),
            )
            self.sample_ids[at] = ids[of]
            self.written[at] = status[of] == STATUS_WRITTEN
            self.images.update(
                (i, images[i]) for i in range(sh.sample_begin, sh.sample_end) if i in images
            )
        self.shards += new
        self.seen.update(sh.index for sh in new)
        return new

    @property
    def visible(self) -> np.ndarray:
        """Store indices of the written samples of the committed shards seen, ascending."""
        return np.flatnonzero(self.written)

    def complete(self) -> bool:
        """Every shard of a finished plan is committed: nothing more will come."""
        store = self.store
        return store.planned and len(self.seen) == len(store.shards)

    def check(self, cause: BaseException | None = None) -> None:
        """The store's attributes read afresh (`bound_attributes`: StoreReplaced if the URL
        holds another store now, or none), and with them `last_report` (the report of its
        last finished run; None: no run ended yet)."""
        location = self.store.group.store
        seen = fingerprint(location)  # before the read: a write after it changes it
        attrs = bound_attributes(self.url, location, self.store_id, cause)
        report = attrs.get("report")
        self.last_report = dict(report) if isinstance(report, Mapping) else None
        self._confirmed = seen

    def confirm(self) -> None:
        """After a read, before its rows are handed out: StoreReplaced unless the URL still
        holds this store, so they were this store's rows (a store's id never comes back once
        it is deleted). Its zarr.json unchanged since it was last read (`fingerprint`: a stat,
        or a HEAD on object storage) proves it; else the store's attributes are read
        (`check`)."""
        if self._confirmed is None or fingerprint(self.store.group.store) != self._confirmed:
            self.check()

    def __getstate__(self) -> dict[str, Any]:
        per_process = {"_store": None, "_rows": None, "_blobs": None, "_blob_cache": OrderedDict()}
        return {**self.__dict__, **per_process}

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
            self._blobs = None
        if self._store is None:
            store = Store.open(self.url, storage_options=self.storage_options)
            # Its attributes were read as it opened: no extra read.
            check_same_store(self.url, self.store_id, store.group.attrs.get("store_id"))
            self._store, self._opened_by = store, os.getpid()
        return self._store

    @property
    def rows(self) -> RowSource:
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
        if self.manifest.mrope:
            positions = rows["position_ids"][a:b].astype(np.int64)
            sample["position_ids"] = torch.from_numpy(positions)
        for name in self.manifest.hidden_arrays:
            sample.update(self._hidden(name, rows, slice(a, b)))
        if self.manifest.has_images:
            sample.update(self._images(i))
        return sample

    def _images(self, i: int) -> dict[str, Any]:
        """Sample i's images: spans [n, 2] (start, length), grids [n, 3], bytes, digests."""
        images = self.images.get(i, [])
        spans = [[im.start, im.length] for im in images]
        return {
            "image_spans": torch.tensor(spans, dtype=torch.int64).reshape(-1, 2),
            "image_grid_thw": torch.tensor(
                [list(im.grid_thw) for im in images], dtype=torch.int64
            ).reshape(-1, 3),
            "images": [self.image_bytes(im.digest) for im in images],
            "image_digests": [im.digest for im in images],
        }

    def image_bytes(self, digest: str) -> bytes:
        """An image's encoded bytes, digest-checked (ImageBlobs.get), from a small cache by
        digest (IMAGE_CACHE_BYTES) where it was read lately."""
        cache = self._blob_cache
        if digest in cache:
            cache.move_to_end(digest)
            return cache[digest]
        store = self.store  # first: refuses a forked copy of a remote store
        if self._blobs is None:
            self._blobs = ImageBlobs(store)
        data = self._blobs.get(digest)
        cache[digest] = data
        while sum(map(len, cache.values())) > IMAGE_CACHE_BYTES and len(cache) > 1:
            cache.popitem(last=False)
        return data

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
    def store_id(self) -> str | None:
        """The store this reader reads (None: a store made before store ids)."""
        return self._view.store_id

    @property
    def sample_indices(self) -> np.ndarray:
        """Store indices of the visible samples, ascending (item k of the Dataset is the k-th)."""
        return self._view.visible

    def __len__(self) -> int:  # for the iterable: across all consumers, as seen so far
        return int(self._view.written.sum())


class HiddenStatesDataset(_VisibleSamples, Dataset):
    """Random access: item k is the k-th visible sample, in store (= plan) order, of the
    shards committed when it was built (a snapshot: follow a running job with the iterable)."""

    def __init__(
        self,
        url: str,
        storage_options: Mapping[str, Any] | None = None,
        fp8: Fp8Mode = "dequantize",
    ) -> None:
        self._view = _StoreView(url, storage_options, fp8=fp8)
        self._visible = self._view.visible

    @property
    def sample_indices(self) -> np.ndarray:
        return self._visible

    def __getitem__(self, k: int) -> Sample:
        if not -len(self) <= k < len(self):
            raise IndexError(f"sample {k} out of range for {len(self)} visible samples")
        i = int(self._visible[k])
        start, length = int(self._view.sample_start[i]), int(self._view.sample_length[i])
        rows = self._view.read_rows(start, start + length)
        self._view.confirm()
        return self._view.sample(i, rows, start)


class HiddenStatesIterable(_VisibleSamples, IterableDataset):
    """Sequential and shard-aware; with `follow=True`, it follows a running job.

    **Who reads what.** Each consumer (`world_size` ranks x DataLoader workers each) takes the
    committed shards k with (k + r) % consumers == its number, r = 0 unshuffled, else drawn
    from (seed, epoch): the rule needs no knowledge of the other shards, so it holds as shards
    commit mid-epoch, and every visible sample is yielded exactly once per epoch across the
    consumers. A consumer reads its shards in index order, or `shuffle`d by (seed, epoch) (the
    same on every rank: call `set_epoch` before each epoch).

    **Follow mode.** The shards committed when iteration starts come first; then the reader
    polls the store (every `poll_s`, backing off to `max_poll_s` while nothing commits) and
    reads each new shard of its own. A shard is yielded only once committed, and never twice: a
    shard commits once (a tail duplicate that loses the claim never commits). It ends when the
    plan is complete and every shard committed, when a run of the job ends (a new report in
    the store; a later commit is still read first), or after `idle_timeout_s` without a new
    commit (None: never); `ended` says which, and it is logged.

    **A cursor.** `state_dict()` says which of its shards this consumer finished this epoch
    and how many samples of the current one it yielded, and of which store (`store_id`);
    `load_state_dict()` before iterating resumes right after them, so a trainer that
    checkpoints it sees every sample once across a restart, also while the job still writes.
    A cursor of another store is refused. With DataLoader workers, use torchdata's
    `StatefulDataLoader`, which keeps one per worker.

    **Its store.** Each iteration starts by checking that the URL still holds the store the
    reader was built on, each poll after reading the commits, and each block once its rows
    have arrived, before any of them is yielded: another store there (deleted and made again)
    raises `StoreReplaced`.

    Each shard is read in contiguous blocks of whole samples of at most `block_bytes` (one read
    per array per block; a larger sample is a block of its own), so memory stays bounded; 16 MB
    blocks read fastest here (malloc reuses their memory, where larger ones are mapped afresh
    and page-faulted in). The next blocks are read while the consumer works on the current one,
    at most `concurrency` reads in flight and about `prefetch_bytes` ahead (at least the next
    block). Defaults: local files 8 reads and 128 MB (hsx_store/file_rows.py); object storage 8
    GETs and 256 MB of whole chunk objects, each fetched once (hsx_store/object_rows.py)."""

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
        follow: bool = False,
        poll_s: float = 2.0,
        max_poll_s: float = 10.0,
        idle_timeout_s: float | None = 1800.0,
    ) -> None:
        if not 0 < poll_s <= max_poll_s:
            raise ValueError(f"need 0 < poll_s <= max_poll_s, got {poll_s} and {max_poll_s}")
        self._view = _StoreView(url, storage_options, concurrency, prefetch_bytes, fp8)
        self.rank, self.world_size = rank, world_size
        self.shuffle, self.seed, self.epoch = shuffle, seed, 0
        self.block_bytes = block_bytes
        self.follow, self.poll_s, self.max_poll_s = follow, poll_s, max_poll_s
        self.idle_timeout_s = idle_timeout_s
        self.ended: str | None = None  # why the last followed iteration ended
        self._cursor: Cursor | None = None  # the iteration under way (or the last one)
        self._loaded: dict[str, Any] | None = None  # a saved cursor, for the next iteration

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

    # -- the cursor --------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Where this consumer is: save it with the trainer's checkpoint."""
        if self._cursor is not None and self._cursor.epoch == self.epoch:
            return self._cursor.state()
        if self._loaded is not None:
            return dict(self._loaded)
        return self._new_cursor().state()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from a saved `state_dict()` at the next iteration (its epoch becomes this
        reader's). Refused if saved reading another store."""
        mine = _describe(self.store_id)
        if state.get("version") == 1:  # saved before cursors named their store
            raise ValueError(
                f"a reader cursor of version 1 names no store, so it cannot be checked against "
                f"{self._view.url} (store_id {mine}); if it was saved reading this very store, "
                f"load it as {{**cursor, 'version': {CURSOR_VERSION}, 'store_id': "
                f"{self.store_id!r}}}; otherwise load none (the epoch is read from its start)"
            )
        if state.get("version") != CURSOR_VERSION:
            raise ValueError(f"not a reader cursor of version {CURSOR_VERSION}: {dict(state)}")
        if state.get("store_id") != self.store_id:
            raise ValueError(
                f"this cursor was saved reading store_id "
                f"{_describe(state.get('store_id'))}, not {self._view.url} (store_id "
                f"{mine}): its shards are another store's (one made again at a URL is another "
                "store). Resume from a checkpoint of this store, or load none (the epoch is "
                "read from its start)"
            )
        self._loaded, self._cursor = dict(state), None
        self.epoch = int(state["epoch"])

    def _new_cursor(self) -> Cursor:
        return Cursor(self.epoch, self.seed, self.shuffle, *self._consumer(), self.store_id)

    def _start(self) -> Cursor:
        cursor = self._new_cursor()
        loaded, self._loaded = self._loaded, None
        if loaded is not None and int(loaded["epoch"]) == self.epoch:
            cursor.resume(loaded)
        self._cursor = cursor
        return cursor

    # -- reading -----------------------------------------------------------------------------

    def __iter__(self) -> Iterator[Sample]:
        cursor = self._start()
        view, self.ended = self._view, None
        poll, last_commit = self.poll_s, time.monotonic()
        view.check()  # still this reader's store? and the report there now
        report = view.last_report
        while True:
            batch = self._assigned(cursor)
            if batch:
                yield from self._read(batch, cursor)
            if not self.follow:
                return
            ended = self._end(report)
            if view.refresh():  # before ending too: a commit just before the report
                poll, last_commit = self.poll_s, time.monotonic()
                continue
            idle = time.monotonic() - last_commit
            if ended is None and self.idle_timeout_s is not None and idle > self.idle_timeout_s:
                ended = f"no shard committed for {self.idle_timeout_s:g} s"
            if ended is not None:
                self.ended = ended
                log.info("%s: following ended: %s", view.url, ended)
                return
            time.sleep(poll)
            poll = min(poll * 1.5, self.max_poll_s)

    def _end(self, report_at_start: dict[str, Any] | None) -> str | None:
        """Why following ends, from the report the last refresh read (after its commits: the
        refresh made next reads every commit made before that report)."""
        if self._view.complete():
            return COMPLETE
        report = self._view.last_report
        if report is not None and report != report_at_start:
            missing = len(self._view.store.shards) - len(self._view.seen)
            return (
                f"a run of the job ended (ok: {report.get('ok')}); {missing} shards not committed"
            )
        return None

    def _assigned(self, cursor: Cursor) -> list[Shard]:
        """This consumer's committed shards not read yet, in reading order (the shard it
        stopped in first); shards with nothing visible are done at once."""
        turn = cursor.turn()
        mine = [
            sh
            for sh in self._view.shards
            if (sh.index + turn) % cursor.consumers == cursor.consumer
            and sh.index not in cursor.done
        ]
        mine.sort(key=cursor.order)
        batch = []
        for sh in mine:
            if self._view.written[sh.sample_begin : sh.sample_end].any():
                batch.append(sh)
            else:
                cursor.done.add(sh.index)
        return batch

    def _read(self, shards: list[Shard], cursor: Cursor) -> Iterator[Sample]:
        written = self._view.written
        skip = {cursor.shard: cursor.samples} if cursor.shard is not None else {}
        last = {
            sh.index: sh.sample_begin
            + int(np.flatnonzero(written[sh.sample_begin : sh.sample_end])[-1])
            for sh in shards
        }
        blocks = (block for shard in shards for block in self._blocks(shard))
        for block, rows in self._view.read_blocks(blocks):
            self._view.confirm()  # its rows have arrived: were they this store's?
            k, first, stop = block.tag
            for n in range(first, stop):
                if not written[n]:
                    continue
                if skip.get(k, 0) > 0:  # yielded before the cursor was saved
                    skip[k] -= 1
                    continue
                sample = self._view.sample(n, rows, block.begin)
                cursor.yielded(k, done=n == last[k])
                yield sample
            del rows  # its buffers are free once the consumer lets go of the samples

    def _blocks(self, shard: Shard) -> Iterator[Block]:
        """The shard's blocks holding a written sample: rows of samples [first, stop) with the
        shard as `tag`, grown by whole samples while they fit in block_bytes (at least one)."""
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
            if v.written[i:j].any():  # not only failed samples
                yield Block(begin, end, (shard.index, i, j))
            i = j


CURSOR_VERSION = 2  # 2: `store_id`


class Cursor:
    """One consumer's place in one epoch of one store: the shards it finished, and how many
    samples of the one it is in it yielded. Its order and share of the shards follow from
    (seed, epoch)."""

    def __init__(
        self,
        epoch: int,
        seed: int,
        shuffle: bool,
        consumer: int,
        consumers: int,
        store_id: str | None,
    ) -> None:
        self.epoch, self.seed, self.shuffle = epoch, seed, shuffle
        self.consumer, self.consumers, self.store_id = consumer, consumers, store_id
        self.done: set[int] = set()
        self.shard: int | None = None
        self.samples = 0

    def turn(self) -> int:
        """The rotation of the shards over the consumers this epoch."""
        return _mix(self.seed, self.epoch, -1) % self.consumers if self.shuffle else 0

    def order(self, shard: Shard) -> tuple[int, int]:
        """The sort key of a shard: the one stopped in first, then index order or shuffled."""
        first = 0 if shard.index == self.shard else 1
        return first, _mix(self.seed, self.epoch, shard.index) if self.shuffle else shard.index

    def yielded(self, shard: int, done: bool) -> None:
        if shard != self.shard:
            self.shard, self.samples = shard, 0
        self.samples += 1
        if done:
            self.done.add(shard)
            self.shard, self.samples = None, 0

    def state(self) -> dict[str, Any]:
        return {
            "version": CURSOR_VERSION,
            "store_id": self.store_id,
            "epoch": self.epoch,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "consumer": self.consumer,
            "consumers": self.consumers,
            "done": sorted(self.done),
            "shard": self.shard,
            "samples": self.samples,
        }

    def resume(self, state: Mapping[str, Any]) -> None:
        """Take up a saved cursor of the same epoch; refused if saved by another consumer or
        for another order (its shards would not be this consumer's)."""
        saved = {k: state[k] for k in ("seed", "shuffle", "consumer", "consumers")}
        mine = {"seed": self.seed, "shuffle": self.shuffle}
        mine |= {"consumer": self.consumer, "consumers": self.consumers}
        if saved != mine:
            raise ValueError(
                f"this cursor was saved by another reader: saved {saved}, this one is {mine} "
                "(same seed, shuffle, ranks and DataLoader workers are needed to resume)"
            )
        self.done = {int(k) for k in state["done"]}
        self.shard = None if state["shard"] is None else int(state["shard"])
        self.samples = int(state["samples"])


def _mix(seed: int, epoch: int, value: int) -> int:
    """A stable 64-bit hash of three integers (the same in every process and Python)."""
    data = f"{seed}:{epoch}:{value}".encode()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")
