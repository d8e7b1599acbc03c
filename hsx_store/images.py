"""The images of an image store: each sample's spans, and the encoded images themselves.

    image = SampleImage(digest, start, length, grid_thw)    # one span of a sample
    blobs = ImageBlobs(store)
    blobs.put(image_digest(data), data)                      # once; skipped when present
    data = blobs.get(digest)                                 # checked against its digest

An image is kept once, as the bytes it was read as (PNG, JPEG, ...), under `images/<digest>`
beside the Zarr arrays (zarr ignores keys that are no node of its hierarchy), its digest the
sha256 of those bytes: content-addressed, so a put is idempotent and a get proves what it read.
The store's image table (`image_*` arrays: docs/store-format.md) says which sample holds which
image where. Local files are private (0600), written whole (a temporary renamed over the key);
on object storage a put only creates (If-None-Match on S3).
"""

from __future__ import annotations

import hashlib
import os
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import zarr
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
    storage), as the store is."""

    def __init__(self, store: _OpenStore) -> None:
        self.location = store.group.store
        self.root = Path(self.location.root) if isinstance(self.location, LocalStore) else None

    def put(self, digest: str, data: bytes) -> None:
        """Keep `data` as image `digest` (refused unless it is its sha256); nothing to do
        where it is already there."""
        key = _key(digest)
        if image_digest(data) != digest:
            raise ValueError(f"image {digest}: the bytes given have sha256 {image_digest(data)}")
        if self.root is not None:
            path = self.root / key
            if not path.exists():
                _write_private(path, data)
        elif not sync(self.location.exists(key)):  # a HEAD saves re-sending the bytes
            sync(self.location.set_if_not_exists(key, Buffer.from_bytes(data)))

    def get(self, digest: str) -> bytes:
        """Image `digest`'s bytes; StoreFormatError naming it if missing or not those bytes."""
        key = _key(digest)
        if self.root is not None:
            try:
                data = (self.root / key).read_bytes()
            except FileNotFoundError:
                data = None
        else:
            buf = sync(self.location.get(key, prototype=default_buffer_prototype()))
            data = None if buf is None else buf.to_bytes()
        if data is None:
            raise StoreFormatError(f"{self.location}: image {digest} is missing ({key})")
        if (found := image_digest(data)) != digest:
            raise StoreFormatError(
                f"{self.location}: image {digest} is damaged: its bytes have sha256 {found}"
            )
        return data


def _key(digest: str) -> str:
    return f"{PREFIX}/{check_digest(digest)}"


def _write_private(path: Path, data: bytes) -> None:
    """`data` as the file at `path`, mode 0600, whole or not at all (a temporary renamed)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.partial")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            view = memoryview(data)
            while view.nbytes:  # a short write: resume where it stopped
                view = view[os.write(fd, view) :]
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


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
