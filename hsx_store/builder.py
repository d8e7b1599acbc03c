"""The driver's side of a store's plan: created empty, then grown shard by shard as planned.

    builder = StoreBuilder.create(url, manifest, job=...)      # every array, no plan row yet
    for sample_id, ids, mask in planned:                       # streamed, in plan order
        for shard in builder.add(sample_id, ids, mask):        # shards planned and visible
            queue.add(shard.index)
    builder.finish(rejected)                                   # exact shapes, `planned` last

A shard is planned exactly when its `shard_plan_sha256` entry is there (written after its rows);
arrays grow ahead in doubling steps (metadata only); `finish` writes `planned` last.
`StoreBuilder.resume` continues an interrupted plan, checking each stored shard against its
digest. `create_store` plans a store from a whole plan in memory at once (tests, benchmarks).

The order of the writes, and why every state a reader sees is consistent: docs/store-format.md.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import obstore.exceptions
import zarr
from zarr.core.sync import sync

from hsx_store.format import (
    PER_SAMPLE_BLOCK,
    PER_SHARD_BLOCK,
    Manifest,
    Shard,
    Store,
    _compressors,
    _round_up,
    plan_digest,
    stored_arrays,
)
from hsx_store.location import StoreAccessError, describe_failure, first_key, open_location

FLUSH_SHARDS = 64  # shards written together (one call per array); the caller flushes sooner


class PlanDiverged(ValueError):
    """A resumed plan does not reproduce a shard the store already holds."""


class StoreBuilder:
    def __init__(self, store: Store, done_shards: int = 0) -> None:
        self.store = store
        self.m = store.manifest
        self._verify_below = done_shards  # shards already in the store: checked, not written
        self._stored_digests: np.ndarray | None = None  # theirs, read at the first check
        self._pending: list[tuple[str, np.ndarray, np.ndarray]] = []  # the open shard's samples
        self._ready: list[tuple[Shard, list[tuple[str, np.ndarray, np.ndarray]]]] = []
        # The stream always starts from the first sample: on a resume, shards below
        # `done_shards` come again and are checked.
        self._next_sample = self._next_token = self._shards = 0

    # -- creation ---------------------------------------------------------------------------

    @classmethod
    def create(
        cls,
        url: str | Path,
        manifest: Manifest,
        job: Mapping[str, Any] | None = None,
        overwrite: bool = False,
        storage_options: Mapping[str, Any] | None = None,
    ) -> StoreBuilder:
        """Every array (empty) and attribute (`store_id` a fresh uuid) but `rejected` and
        `planned`; `created` last.
        Fails if something already exists there, unless `overwrite` (for a store whose
        creation was interrupted)."""
        location = open_location(url, storage_options)
        if not overwrite:
            require_empty(location, url, storage_options)
        m = manifest
        # `store_id`: new at every creation, so what was made from an earlier store at the
        # same URL (an export) can tell this one apart even with the same manifest and job.
        attrs = {
            "manifest": m.to_json(),
            "rejected": [],
            "job": dict(job or {}),
            "store_id": uuid.uuid4().hex,
        }
        group = zarr.create_group(
            store=location, zarr_format=3, attributes=attrs, overwrite=overwrite
        )
        comp = _compressors(m.codec)
        c, per_shard = m.chunk_tokens, m.samples_per_shard

        def new(name: str, shape: tuple[int, ...], dtype: Any, chunks: tuple[int, ...], **kw):
            group.create_array(
                name, shape=shape, dtype=dtype, chunks=chunks, fill_value=kw.pop("fill", 0), **kw
            )

        new("input_ids", (0,), "int32", (c,), compressors=comp)
        new("loss_mask", (0,), "uint8", (c,), compressors=comp)
        for a in stored_arrays(m):  # hidden states (and an FP8 store's scales)
            new(
                a.name,
                (0, *a.row_shape),
                a.dtype,
                (c, *a.row_shape),
                compressors=comp,
                attributes=a.attributes,
            )
        new("sample_start", (0,), "int64", (PER_SAMPLE_BLOCK,))
        new("sample_length", (0,), "int32", (PER_SAMPLE_BLOCK,))
        new("sample_id", (0,), str, (per_shard,), fill="")  # a worker reads its shard's in one
        new("sample_status", (0,), "uint8", (per_shard,))  # a worker writes its shard's chunk
        new("shard_committed", (0,), "uint8", (1,))  # one writer per element: one chunk each
        new("shard_summary", (0,), str, (1,), fill="")
        new("shard_plan_sha256", (0,), str, (PER_SHARD_BLOCK,), fill="")
        group.attrs["created"] = True  # the arrays exist: workers may open it from now on
        return cls(Store.from_group(group))

    @classmethod
    def resume(cls, store: Store) -> StoreBuilder:
        """Continue planning a store whose planning was interrupted (see the module doc)."""
        return cls(store, done_shards=len(store.shards))

    # -- growing ----------------------------------------------------------------------------

    def add(self, sample_id: str, input_ids: np.ndarray, loss_mask: np.ndarray) -> list[Shard]:
        """Append one planned sample; returns the shards this made visible (often none)."""
        if len(loss_mask) != len(input_ids) or not 0 < len(input_ids) <= self.m.max_length:
            raise ValueError(f"sample {sample_id!r}: bad length or loss mask length")
        self._pending.append((sample_id, input_ids, loss_mask))
        if len(self._pending) == self.m.samples_per_shard:
            self._close_shard()
        return self.flush() if len(self._ready) >= FLUSH_SHARDS else []

    def finish(self, rejected: Sequence[Mapping[str, str]]) -> list[Shard]:
        """The last (partial) shard, exact shapes, the rejects, then `planned`; returns the
        shards this made visible."""
        if self._pending:
            self._close_shard()
        shards = self.flush()
        planned = self.store.shards
        if self._shards < self._verify_below:
            raise PlanDiverged(
                f"the plan now ends at shard {self._shards}; the store holds "
                f"{self._verify_below} planned shards"
            )
        n = planned[-1].sample_end if planned else 0
        total = _round_up(planned[-1].token_end, self.m.chunk_tokens) if planned else 0
        self._resize(total, n, len(planned), exact=True)
        group = self.store.group
        group.attrs["rejected"] = [dict(r) for r in rejected]
        group.attrs["planned"] = True  # the plan's commit: every shard and reject is in
        self.store.planned = True
        return shards

    def flush(self) -> list[Shard]:
        """Write the closed shards' plan rows, then their digests; returns them."""
        ready, self._ready = self._ready, []
        new = [(sh, samples) for sh, samples in ready if sh.index >= self._verify_below]
        if old := [(sh, samples) for sh, samples in ready if sh.index < self._verify_below]:
            self._check_planned(old)
        if not new:
            return []
        first, last = new[0][0], new[-1][0]
        stop = _round_up(last.token_end, self.m.chunk_tokens)
        self._resize(stop, last.sample_end, last.index + 1, exact=False)
        ids = np.zeros(stop - first.token_begin, np.int32)
        mask = np.zeros(stop - first.token_begin, np.uint8)
        starts, lengths, names, digests = [], [], [], []
        for sh, samples in new:
            pos = sh.token_begin
            for name, sample_ids, sample_mask in samples:
                at = pos - first.token_begin
                ids[at : at + len(sample_ids)] = sample_ids
                mask[at : at + len(sample_ids)] = sample_mask
                starts.append(pos)
                lengths.append(len(sample_ids))
                names.append(name)
                pos += len(sample_ids)
            used = slice(sh.token_begin - first.token_begin, sh.token_end - first.token_begin)
            digests.append(plan_digest(ids[used], mask[used]))
        array = self.store.array
        array("input_ids")[first.token_begin : stop] = ids
        array("loss_mask")[first.token_begin : stop] = mask
        samples_slice = slice(first.sample_begin, last.sample_end)
        array("sample_start")[samples_slice] = np.array(starts, np.int64)
        array("sample_length")[samples_slice] = np.array(lengths, np.int32)
        array("sample_id")[samples_slice] = np.array(names, dtype=str)
        array("shard_plan_sha256")[first.index : last.index + 1] = np.array(digests, dtype=str)
        self.store.extend([sh for sh, _ in new], starts, lengths)
        return [sh for sh, _ in new]

    # -- internals --------------------------------------------------------------------------

    def _close_shard(self) -> None:
        samples, self._pending = self._pending, []
        begin, pos = self._next_sample, self._next_token
        end_token = pos + sum(len(ids) for _, ids, _ in samples)
        shard = Shard(self._shards, begin, begin + len(samples), pos, end_token)
        self._shards += 1
        self._next_sample = shard.sample_end
        self._next_token = _round_up(end_token, self.m.chunk_tokens)
        if shard.index < self._verify_below and shard != self.store.shards[shard.index]:
            raise PlanDiverged(f"shard {shard.index}: planned samples differ from the store's")
        self._ready.append((shard, samples))

    def _check_planned(self, ready: list[tuple[Shard, list[tuple[str, np.ndarray, np.ndarray]]]]):
        """Shards the store already holds (a resume) against what was planned again: their
        digests (read once) and their sample ids (read per group)."""
        if self._stored_digests is None:
            digests = self.store.array("shard_plan_sha256")[: self._verify_below]
            self._stored_digests = np.asarray(digests)
        first, last = ready[0][0], ready[-1][0]
        names = self.store.array("sample_id")[first.sample_begin : last.sample_end].tolist()
        for shard, samples in ready:
            ids = np.concatenate([s[1] for s in samples])
            mask = np.concatenate([s[2] for s in samples])
            stored = names[
                shard.sample_begin - first.sample_begin : shard.sample_end - first.sample_begin
            ]
            if plan_digest(ids, mask) != self._stored_digests[shard.index] or stored != [
                s[0] for s in samples
            ]:
                raise PlanDiverged(
                    f"shard {shard.index}: the inputs no longer give the rows the store planned"
                )

    def _resize(self, tokens: int, samples: int, shards: int, exact: bool) -> None:
        """Grow (doubling, ahead of need) or, once `exact`, trim every array; chunks stay."""
        for names, size in (
            (("input_ids", "loss_mask", *(a.name for a in stored_arrays(self.m))), tokens),
            (("sample_start", "sample_length", "sample_id", "sample_status"), samples),
            (("shard_committed", "shard_summary", "shard_plan_sha256"), shards),
        ):
            for name in names:
                array = self.store.array(name)
                have = array.shape[0]
                if exact and have != size:
                    want = size
                elif have < size:
                    want = max(size, 2 * have)
                else:
                    continue
                # No deletes: nothing lies beyond, and zarr would list every chunk to find out.
                sync(array.async_array.resize((want, *array.shape[1:]), False))


def create_store(
    url: str | Path,
    manifest: Manifest,
    sample_ids: Sequence[str],
    input_ids: Sequence[np.ndarray],
    loss_masks: Sequence[np.ndarray],
    rejected: Sequence[Mapping[str, str]] = (),
    job: Mapping[str, Any] | None = None,
    overwrite: bool = False,
    storage_options: Mapping[str, Any] | None = None,
) -> Store:
    """A store planned from a whole plan in memory (tests, tools; the driver streams through
    `StoreBuilder`). `job`: what the plan was made from, kept for resume checks. Fails if
    something already exists there, unless `overwrite`."""
    if not len(sample_ids) == len(input_ids) == len(loss_masks):
        raise ValueError("sample_ids, input_ids and loss_masks differ in length")
    builder = StoreBuilder.create(url, manifest, job, overwrite, storage_options)
    for sample in zip(sample_ids, input_ids, loss_masks, strict=True):
        builder.add(*sample)
    builder.finish(rejected)
    return builder.store


def require_empty(location: Any, url: str, storage_options: Mapping[str, Any] | None) -> None:
    """Raise StoreAccessError naming `url` unless the location holds nothing: a new store needs
    an empty one (no bucket and refused credentials are named too)."""
    try:
        existing = first_key(location)
    except obstore.exceptions.BaseError as exc:  # no bucket, refused credentials, ...
        raise StoreAccessError(describe_failure(url, exc, storage_options)) from None
    if existing is not None:
        raise StoreAccessError(
            f"{url}: not empty (it holds {existing!r}): a new store needs an empty location"
        )
