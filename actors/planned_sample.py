"""A shard's planned samples as the worker sends and checks them: token ids, and for an image
store each sample's images and M-RoPE positions.

    samples = planned_samples(store, shard, image_urls(store))  # index -> PlannedSample
    payload = samples[i].request()  # what /generate takes for it

SGLang expands an image itself (its processor, the HF one): a request carries one image token
per image and the image as a data URL (`image_data`); a prompt already expanded with
`image_data` is never answered (docs/design/images.md). So the request collapses each
planned span to one image token, and the dump's rows are the planned, expanded ones.
"""

from __future__ import annotations

import base64
import io
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from actors.capture_client import CaptureError
from hsx_store.format import Shard, Store
from hsx_store.images import ImageBlobs, SampleImage, collapse


@dataclass(frozen=True)
class PlannedSample:
    input_ids: np.ndarray  # int32, the planned (expanded) tokens
    images: tuple[SampleImage, ...] = ()
    urls: ImageUrls | None = None  # reads its images (an image store)
    position_ids: np.ndarray | None = None  # [P, 3] int32: M-RoPE stores
    image_token_id: int | None = None

    def request(self) -> dict[str, Any]:
        """The /generate fields of its prompt: token ids (spans collapsed) and its images as
        data URLs, in prompt order. An image the store cannot give is this sample's
        CaptureError (retried, then recorded as its failure), never the worker's."""
        if not self.images:
            return {"input_ids": self.input_ids.tolist()}
        assert self.image_token_id is not None and self.urls is not None
        try:
            image_data = [self.urls(image.digest) for image in self.images]
        except Exception as exc:  # a missing or damaged blob, a failed GET
            raise CaptureError(f"cannot read its image: {type(exc).__name__}: {exc}") from exc
        ids = collapse(self.input_ids, self.images, self.image_token_id)
        return {"input_ids": ids, "image_data": image_data}


@dataclass
class ImageUrls:
    """Data URLs of a store's images, each read (and its digest checked) once."""

    blobs: ImageBlobs
    _urls: dict[str, str] = field(default_factory=dict)

    def __call__(self, digest: str) -> str:
        if digest not in self._urls:  # two threads may both read it: the same bytes
            self._urls[digest] = data_url(self.blobs.get(digest))
        return self._urls[digest]


def data_url(data: bytes) -> str:
    """`data:<media type>;base64,...`, the type from the image's own header (PIL)."""
    from PIL import Image

    with Image.open(io.BytesIO(data)) as image:
        mime = Image.MIME.get(image.format or "", "application/octet-stream")
    return f"data:{mime};base64,{base64.b64encode(data).decode('ascii')}"


def planned_samples(store: Store, shard: Shard, urls: ImageUrls | None) -> dict[int, PlannedSample]:
    """Every sample of `shard` as planned; `urls` reads the images (None: a text store)."""
    return _planned(store, shard.sample_begin, shard.sample_end, urls)


def planned_sample(store: Store, i: int, urls: ImageUrls | None) -> PlannedSample:
    """Sample i as planned (one sample: `verify --recompute`)."""
    return _planned(store, i, i + 1, urls)[i]


def _planned(
    store: Store, first: int, stop: int, urls: ImageUrls | None
) -> dict[int, PlannedSample]:
    """Samples [first, stop), their rows read at once (they lie back to back)."""
    m = store.manifest
    begin, end = store.sample_rows(first).start, store.sample_rows(stop - 1).stop
    ids = np.asarray(store.group["input_ids"][begin:end])
    positions = None
    if m.position_ids is not None:
        positions = np.asarray(store.group["position_ids"][begin:end])
    images = store.sample_images(first, stop) if urls else {}
    planned = {}
    for i in range(first, stop):
        rows = store.sample_rows(i)
        at = slice(rows.start - begin, rows.stop - begin)
        planned[i] = PlannedSample(
            ids[at],
            tuple(images.get(i, ())),
            urls,
            None if positions is None else positions[at],
            m.image_token_id,
        )
    return planned


def image_urls(store: Store) -> ImageUrls | None:
    """The reader of a store's images (None: the store holds none)."""
    return ImageUrls(ImageBlobs(store)) if store.manifest.image_token_id is not None else None
