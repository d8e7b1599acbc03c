"""A shard's planned samples as the worker sends them: an image sample's request collapses each
span to one image token and carries its images, read from the store, as data URLs; an image the
store cannot give fails that sample's request (CaptureError), not the shard."""

from __future__ import annotations

import base64
import dataclasses
import io
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from actors.capture_client import CaptureError
from actors.planned_sample import image_urls, planned_samples
from hsx_store.builder import create_store
from hsx_store.images import SampleImage, image_digest
from tests.helpers.synthetic import manifest

TOKEN = 12


def png(seed: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (8, 8, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def test_requests_carry_collapsed_ids_and_the_stored_images_and_a_lost_image_fails_its_sample(
    tmp_path: Path,
) -> None:
    a, b = png(0), png(1)
    ids = [
        np.array([1, TOKEN, TOKEN, TOKEN, 5, TOKEN, TOKEN, 6], np.int32),
        np.array([3, 4], np.int32),
        np.array([TOKEN, TOKEN, 7], np.int32),
    ]
    da, db = image_digest(a), image_digest(b)
    images = [
        [SampleImage(da, 1, 3, (1, 2, 6)), SampleImage(db, 5, 2, (1, 2, 4))],
        [],
        [SampleImage(db, 0, 2, (1, 2, 4))],
    ]
    positions = [np.repeat(np.arange(len(x), dtype=np.int32)[:, None], 3, axis=1) for x in ids]
    m = dataclasses.replace(
        manifest(), samples_per_shard=3, image_token_id=TOKEN, position_ids="mrope"
    )
    store = create_store(
        tmp_path / "s.zarr",
        m,
        ["x", "y", "z"],
        ids,
        [(x != TOKEN).astype(np.uint8) for x in ids],
        position_ids=positions,
        images=images,
        image_bytes={da: a, db: b},
    )
    planned = planned_samples(store, store.shards[0], image_urls(store))
    first = planned[0].request()
    assert first["input_ids"] == [1, TOKEN, 5, TOKEN, 6]
    sent = [base64.b64decode(u.removeprefix("data:image/png;base64,")) for u in first["image_data"]]
    assert sent == [a, b] and all(
        u.startswith("data:image/png;base64,") for u in first["image_data"]
    )
    assert planned[1].request() == {"input_ids": [3, 4]}
    assert np.array_equal(planned[0].position_ids, positions[0])

    (tmp_path / "s.zarr" / "images" / da).unlink()
    lost = planned_samples(store, store.shards[0], image_urls(store))
    with pytest.raises(CaptureError, match=f"cannot read its image: .*{da}"):
        lost[0].request()
    assert lost[2].request()["input_ids"] == [TOKEN, 7]  # the other image is still there
