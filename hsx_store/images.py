"""The images of an image store: each sample's spans, and the encoded images themselves.

    image = SampleImage(digest, start, length, grid_thw)    # one span of a sample
    blobs = ImageBlobs(store)          # or ImageBlobs(open_location(url, storage_options))
    blobs.put(image_digest(data), data)                      # once; skipped when present
    data = blobs.get(digest)                                 # checked against its digest

An image is kept once, as the bytes it was read as (PNG, JPEG, ...), under `images/<digest>`
beside the Zarr arrays (zarr ignores keys that are no node of its hierarchy), its digest the
sha256 of those bytes: content-addressed, so a put is idempotent and a get proves what it read.
The store's image table (`image_*` arrays: docs/store-format.md) says which sample holds which
image where. The planning task of a part puts its images (cluster/plan.py) before the driver
adds the rows naming them. A put writes through the store's own location, as its chunks are
(a local file written whole: a temporary renamed over the key); on object storage it only
creates (If-None-Match on S3).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import zarr
from zarr.abc.store import Store as ZarrStore
from zarr.core.buffer import default_buffer_prototype
from zarr.core.buffer.cpu import Buffer
from zarr.core.sync import sync
from zarr.storage import LocalStore

from hsx_store.store_errors import StoreFormatError

PREFIX = "images"
_DIGEST = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class SampleImage:
    """One image of a sample: its span of rows, all `image_token_id`."""

    digest: str  # sha256 hex of the encoded image bytes, as read
    start: int  # the span's first row, within its sample
    length: int  # rows of the span
    grid_thw: tuple[int, int, int]  # the processor's image_grid_thw row


def image_digest(data: bytes) -> str:
    """sha256 hex of an encoded image: its name in the store."""
    return hashlib.sha256(data).hexdigest()


def check_digest(digest: str) -> str:
    """`digest` if it is a sha256 hex digest (lowercase), else ValueError: it names a key."""
    if not isinstance(digest, str) or not _DIGEST.fullmatch(digest):
        raise ValueError(f"image digest {digest!r} is not a sha256 hex digest")
    return digest


class _OpenStore(Protocol):  # hsx_store/format.py's Store (which builds on this module)
    group: zarr.Group


class ImageBlobs:
    """The encoded images under `images/` of a store's location (a local directory, or object
    storage), as the store is. `store`: an open store, or its location as
    hsx_store.location.open_location gives it (a local path, or a zarr store): a planning
    process puts images without opening the store."""

    def __init__(self, store: _OpenStore | ZarrStore | str | Path) -> None:
        if isinstance(store, str | Path):
            self.location: ZarrStore = LocalStore(str(store))
        elif isinstance(store, ZarrStore):
            self.location = store
        else:
            self.location = store.group.store

    def put(self, digest: str, data: bytes) -> None:
        """Keep `data` as image `digest` (refused unless it is its sha256); nothing to do
        where it is already there."""
        key = _key(digest)
        if image_digest(data) != digest:
            raise ValueError(f"image {digest}: the bytes given have sha256 {image_digest(data)}")
        if not sync(self.location.exists(key)):  # a HEAD saves re-sending the bytes
            sync(self.location.set_if_not_exists(key, Buffer.from_bytes(data)))

    def get(self, digest: str) -> bytes:
        """Image `digest`'s bytes; StoreFormatError naming it if missing or not those bytes."""
        key = _key(digest)
        buf = sync(self.location.get(key, prototype=default_buffer_prototype()))
        if buf is None:
            raise StoreFormatError(f"{self.location}: image {digest} is missing ({key})")
        data = buf.to_bytes()
        if (found := image_digest(data)) != digest:
            raise StoreFormatError(
                f"{self.location}: image {digest} is damaged: its bytes have sha256 {found}"
            )
        return data


def _key(digest: str) -> str:
    return f"{PREFIX}/{check_digest(digest)}"


def collapse(
    input_ids: np.ndarray | Sequence[int], images: Sequence[SampleImage], image_token_id: int
) -> list[int]:
    """The ids a request sends: each image's span replaced by one image token (the server
    expands it again), in prompt order."""
    ids = np.asarray(input_ids).tolist()
    out: list[int] = []
    at = 0
    for image in sorted(images, key=lambda im: im.start):
        out += ids[at : image.start]
        out.append(image_token_id)
        at = image.start + image.length
    return out + ids[at:]


def stray_image_token(
    input_ids: np.ndarray, images: Sequence[SampleImage], image_token_id: int
) -> str | None:
    """What is wrong where a sample's ids hold the image token outside every image span (the
    model would meet an image token without an image); None where none does."""
    stray = np.asarray(input_ids) == image_token_id
    for image in images:
        stray[max(image.start, 0) : max(image.start + image.length, 0)] = False
    if not stray.any():
        return None
    rows = np.flatnonzero(stray)
    return (
        f"{rows.size} image tokens ({image_token_id}) outside every image span "
        f"(first: row {int(rows[0])})"
    )
