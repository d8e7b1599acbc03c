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

A store of images (manifest `image_token_id`) also gets its image table rows with the shards'
plan rows; the images themselves are put under `images/` (hsx_store/images.py) by whoever
plans them before their samples are added (cluster/plan.py: the planning task of their part),
so before any row naming them is visible. An M-RoPE store (`position_ids` "mrope") gets its
rows' `position_ids`. The shard digest covers both.

The order of the writes, and why every state a reader sees is consistent: docs/store-format.md.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import obstore.exceptions
import zarr
from zarr.core.sync import sync

from hsx_store.format import (
    NO_IMAGE_SAMPLE,
    PER_SAMPLE_BLOCK,
    PER_SHARD_BLOCK,
    Manifest,
    Shard,
    Store,
    _compressors,
    _round_up,
    image_arrays,
    plan_arrays,
    plan_digest,
    stored_arrays,
)
from hsx_store.images import ImageBlobs, SampleImage, check_digest, stray_image_token
from hsx_store.location import StoreAccessError, describe_failure, first_key, open_location

FLUSH_SHARDS = 64  # shards written together (one call per array); the caller flushes sooner


class PlanDiverged(ValueError):
    """A resumed plan does not reproduce a shard the store already holds."""


@dataclass(frozen=True)
class _Planned:
    """One sample as added: its plan rows, and (image stores) its images."""

    sample_id: str
    input_ids: np.ndarray
    loss_mask: np.ndarray
    position_ids: np.ndarray | None  # [P, 3] int32, M-RoPE stores only
    images: tuple[SampleImage, ...]


class StoreBuilder:
    def __init__(self, store: Store, done_shards: int = 0) -> None:
        self.store = store
        self.m = store.manifest
        self._verify_below = done_shards  # shards already in the store: checked, not written
        self._stored_digests: np.ndarray | None = None  # theirs, read at the first check
        self._pending: list[_Planned] = []  # the open shard's samples
        self._ready: list[tuple[Shard, list[_Planned]]] = []
        # The stream always starts from the first sample: on a resume, shards below
        # `done_shards` come again and are checked.
        self._next_sample = self._next_token = self._shards = 0
        self._images = 0  # image table rows of the shards flushed (or checked) so far

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
        if m.mrope:
            new("position_ids", (0, 3), "int32", (c, 3), compressors=comp)
        if m.has_images:  # the image table (hsx_store/format.py IMAGE_ARRAYS)
            new("image_sample", (0,), "int64", (PER_SAMPLE_BLOCK,), fill=NO_IMAGE_SAMPLE)
            new("image_start", (0,), "int32", (PER_SAMPLE_BLOCK,))
            new("image_length", (0,), "int32", (PER_SAMPLE_BLOCK,))
            new("image_grid_thw", (0, 3), "int32", (PER_SAMPLE_BLOCK, 3))
            new("image_digest", (0,), str, (PER_SAMPLE_BLOCK,), fill="")
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
        builder = cls(store, done_shards=len(store.shards))
        if store.manifest.has_images:
            builder._clear_images_after(store.shards[-1].sample_end if store.shards else 0)
        return builder

    def _clear_images_after(self, samples: int) -> None:
        """Image table rows an interrupted flush left for samples from `samples` on (no
        digest: not planned) read as not written again, so that a plan now giving those
        samples fewer images leaves none of the old rows to them."""
        array = self.store.array("image_sample")
        stored = np.asarray(array[:])
        kept = int(np.searchsorted(stored, samples))
        if (stored[kept:] != NO_IMAGE_SAMPLE).any():
            array[kept:] = np.full(len(stored) - kept, NO_IMAGE_SAMPLE, np.int64)

    # -- growing ----------------------------------------------------------------------------

    def add(
        self,
        sample_id: str,
        input_ids: np.ndarray,
        loss_mask: np.ndarray,
        position_ids: np.ndarray | None = None,
        images: Sequence[SampleImage] = (),
    ) -> list[Shard]:
        """Append one planned sample; returns the shards this made visible (often none).
        `position_ids` [P, 3]: each row's M-RoPE positions (an M-RoPE store's samples, all of
        them). `images`: the sample's image spans in prompt order, each on image tokens with
        loss mask 0, and no image token outside them; each image already in the store
        (ImageBlobs.put)."""
        if len(loss_mask) != len(input_ids) or not 0 < len(input_ids) <= self.m.max_length:
            raise ValueError(f"sample {sample_id!r}: bad length or loss mask length")
        positions = self._checked_positions(sample_id, len(input_ids), position_ids)
        spans = self._checked_images(sample_id, input_ids, loss_mask, images)
        self._pending.append(_Planned(sample_id, input_ids, loss_mask, positions, spans))
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
        self._resize(total, n, len(planned), self._images, exact=True)
        group = self.store.group
        group.attrs["rejected"] = [dict(r) for r in rejected]
        group.attrs["planned"] = True  # the plan's commit: every shard and reject is in
        self.store.planned = True
        return shards

    def flush(self) -> list[Shard]:
        """Write the closed shards' plan rows (and image table rows), then their digests;
        returns them."""
        ready, self._ready = self._ready, []
        new = [(sh, samples) for sh, samples in ready if sh.index >= self._verify_below]
        if old := [(sh, samples) for sh, samples in ready if sh.index < self._verify_below]:
            self._check_planned(old)
            self._images += sum(len(s.images) for _, samples in old for s in samples)
        if not new:
            return []
        first, last = new[0][0], new[-1][0]
        first_image = self._images
        self._images += sum(len(s.images) for _, samples in new for s in samples)
        stop = _round_up(last.token_end, self.m.chunk_tokens)
        self._resize(stop, last.sample_end, last.index + 1, self._images, exact=False)
        ids = np.zeros(stop - first.token_begin, np.int32)
        mask = np.zeros(stop - first.token_begin, np.uint8)
        positions = np.zeros((stop - first.token_begin, 3), np.int32) if self.m.mrope else None
        starts, lengths, names, digests = [], [], [], []
        table: list[tuple[int, SampleImage]] = []  # the image table rows, in order
        for sh, samples in new:
            pos, shard_images = sh.token_begin, _images_of(sh, samples)
            for sample in samples:
                at, n = pos - first.token_begin, len(sample.input_ids)
                ids[at : at + n] = sample.input_ids
                mask[at : at + n] = sample.loss_mask
                if positions is not None:
                    positions[at : at + n] = sample.position_ids
                starts.append(pos)
                lengths.append(n)
                names.append(sample.sample_id)
                pos += n
            used = slice(sh.token_begin - first.token_begin, sh.token_end - first.token_begin)
            shard_positions = None if positions is None else positions[used]
            digests.append(plan_digest(ids[used], mask[used], shard_positions, shard_images))
            table += shard_images
        array = self.store.array
        array("input_ids")[first.token_begin : stop] = ids
        array("loss_mask")[first.token_begin : stop] = mask
        if positions is not None:
            array("position_ids")[first.token_begin : stop] = positions
        if table:
            self._write_images(first_image, table)
        samples_slice = slice(first.sample_begin, last.sample_end)
        array("sample_start")[samples_slice] = np.array(starts, np.int64)
        array("sample_length")[samples_slice] = np.array(lengths, np.int32)
        array("sample_id")[samples_slice] = np.array(names, dtype=str)
        array("shard_plan_sha256")[first.index : last.index + 1] = np.array(digests, dtype=str)
        self.store.extend([sh for sh, _ in new], starts, lengths)
        return [sh for sh, _ in new]

    # -- internals --------------------------------------------------------------------------

    def _checked_positions(
        self, sample_id: str, rows: int, position_ids: np.ndarray | None
    ) -> np.ndarray | None:
        """An M-RoPE store's sample's position ids as int32 [rows, 3]; refused where missing
        or shaped otherwise, and in a store that keeps none."""
        if not self.m.mrope:
            if position_ids is not None:
                raise ValueError(
                    f"sample {sample_id!r}: position_ids given, but the store keeps none "
                    "(manifest position_ids is None)"
                )
            return None
        if position_ids is None:
            raise ValueError(f"sample {sample_id!r}: an M-RoPE store needs its position_ids")
        positions = np.asarray(position_ids)
        if positions.shape != (rows, 3) or positions.dtype.kind not in "iu":
            raise ValueError(
                f"sample {sample_id!r}: position_ids must be integers [{rows}, 3], got "
                f"{positions.dtype} {list(positions.shape)}"
            )
        return positions.astype(np.int32)

    def _checked_images(
        self,
        sample_id: str,
        input_ids: np.ndarray,
        loss_mask: np.ndarray,
        images: Sequence[SampleImage],
    ) -> tuple[SampleImage, ...]:
        """The sample's images as plain ints, each span inside the sample after the one
        before it, all on image tokens with loss mask 0, and no image token outside every
        span (the model would meet an image token without an image); refused otherwise."""
        token = self.m.image_token_id
        if token is None:
            if images:
                raise ValueError(
                    f"sample {sample_id!r}: images given, but the store holds none (manifest "
                    "image_token_id is None)"
                )
            return ()
        checked, after = [], 0
        for n, image in enumerate(images):
            start, length = int(image.start), int(image.length)
            grid = tuple(int(x) for x in image.grid_thw)
            where = f"sample {sample_id!r}: image {n} (rows {start}..{start + length - 1})"
            try:
                check_digest(image.digest)
            except ValueError as exc:
                raise ValueError(f"{where}: {exc}") from None
            if length < 1 or start < after or start + length > len(input_ids):
                raise ValueError(
                    f"{where}: a span must lie inside the sample's {len(input_ids)} rows, after "
                    f"the image before it (from row {after})"
                )
            if len(grid) != 3 or min(grid) < 1:
                raise ValueError(f"{where}: grid_thw {image.grid_thw!r} is not 3 counts >= 1")
            span = slice(start, start + length)
            if (np.asarray(input_ids[span]) != token).any():
                raise ValueError(f"{where}: not all image tokens ({token})")
            if np.asarray(loss_mask[span]).any():
                raise ValueError(f"{where}: loss mask 1 on an image token")
            checked.append(SampleImage(image.digest, start, length, grid))  # type: ignore[arg-type]
            after = start + length
        if stray := stray_image_token(np.asarray(input_ids), checked, token):
            raise ValueError(f"sample {sample_id!r}: {stray}")
        return tuple(checked)

    def _write_images(self, first: int, table: list[tuple[int, SampleImage]]) -> None:
        """Image table rows first, first + 1, ...: (store sample index, image) each."""
        at = slice(first, first + len(table))
        array = self.store.array
        array("image_sample")[at] = np.array([i for i, _ in table], np.int64)
        array("image_start")[at] = np.array([im.start for _, im in table], np.int32)
        array("image_length")[at] = np.array([im.length for _, im in table], np.int32)
        array("image_grid_thw")[at] = np.array([im.grid_thw for _, im in table], np.int32)
        array("image_digest")[at] = np.array([im.digest for _, im in table], dtype=str)

    def _close_shard(self) -> None:
        samples, self._pending = self._pending, []
        begin, pos = self._next_sample, self._next_token
        end_token = pos + sum(len(s.input_ids) for s in samples)
        shard = Shard(self._shards, begin, begin + len(samples), pos, end_token)
        self._shards += 1
        self._next_sample = shard.sample_end
        self._next_token = _round_up(end_token, self.m.chunk_tokens)
        if shard.index < self._verify_below and shard != self.store.shards[shard.index]:
            raise PlanDiverged(f"shard {shard.index}: planned samples differ from the store's")
        self._ready.append((shard, samples))

    def _check_planned(self, ready: list[tuple[Shard, list[_Planned]]]) -> None:
        """Shards the store already holds (a resume) against what was planned again: their
        digests (read once: they cover the rows, positions and image table rows) and their
        sample ids (read per group)."""
        if self._stored_digests is None:
            digests = self.store.array("shard_plan_sha256")[: self._verify_below]
            self._stored_digests = np.asarray(digests)
        first, last = ready[0][0], ready[-1][0]
        names = self.store.array("sample_id")[first.sample_begin : last.sample_end].tolist()
        for shard, samples in ready:
            ids = np.concatenate([s.input_ids for s in samples])
            mask = np.concatenate([s.loss_mask for s in samples])
            positions = np.concatenate([s.position_ids for s in samples]) if self.m.mrope else None
            stored = names[
                shard.sample_begin - first.sample_begin : shard.sample_end - first.sample_begin
            ]
            digest = plan_digest(ids, mask, positions, _images_of(shard, samples))
            if digest != self._stored_digests[shard.index] or stored != [
                s.sample_id for s in samples
            ]:
                raise PlanDiverged(
                    f"shard {shard.index}: the inputs no longer give the rows the store planned"
                )

    def _resize(self, tokens: int, samples: int, shards: int, images: int, exact: bool) -> None:
        """Grow (doubling, ahead of need) or, once `exact`, trim every array; chunks stay."""
        for names, size in (
            ((*plan_arrays(self.m), *(a.name for a in stored_arrays(self.m))), tokens),
            (("sample_start", "sample_length", "sample_id", "sample_status"), samples),
            (("shard_committed", "shard_summary", "shard_plan_sha256"), shards),
            (image_arrays(self.m), images),
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
    *,
    position_ids: Sequence[np.ndarray] | None = None,
    images: Sequence[Sequence[SampleImage]] | None = None,
    image_bytes: Mapping[str, bytes] | None = None,
) -> Store:
    """A store planned from a whole plan in memory (tests, tools; the driver streams through
    `StoreBuilder`). `job`: what the plan was made from, kept for resume checks. Fails if
    something already exists there, unless `overwrite`. An image store's samples: their
    `position_ids` and `images` (one entry per sample, as `StoreBuilder.add` takes them) and
    every image's bytes by digest (`image_bytes`), put before the first sample is added."""
    n = len(sample_ids)
    if not n == len(input_ids) == len(loss_masks):
        raise ValueError("sample_ids, input_ids and loss_masks differ in length")
    if any(per is not None and len(per) != n for per in (position_ids, images)):
        raise ValueError("position_ids / images must hold one entry per sample")
    builder = StoreBuilder.create(url, manifest, job, overwrite, storage_options)
    blobs = ImageBlobs(builder.store)
    for digest, data in (image_bytes or {}).items():
        blobs.put(digest, data)
    for i, sample in enumerate(zip(sample_ids, input_ids, loss_masks, strict=True)):
        builder.add(
            *sample,
            position_ids=None if position_ids is None else position_ids[i],
            images=() if images is None else images[i],
        )
    builder.finish(rejected)
    return builder.store


def _images_of(shard: Shard, samples: Sequence[_Planned]) -> list[tuple[int, SampleImage]]:
    """A shard's image table rows: (store sample index, image), in order."""
    return [(shard.sample_begin + k, im) for k, s in enumerate(samples) for im in s.images]


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
