"""Stores of images (schema 6): the encoded images kept once by digest and checked when read,
the image table and M-RoPE positions through builder -> Store.sample_images -> both readers,
a resume that notices changed images or positions, verify's image findings (each naming its
sample), the export refused, and a text store written exactly as before."""

from __future__ import annotations

import dataclasses
import hashlib
import os
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import obstore.store
import pytest
import torch
import zarr
from torch.utils.data import DataLoader
from zarr.storage import ObjectStore

from actors.shard_writer import ShardWriter
from hsx_store.builder import PlanDiverged, StoreBuilder, create_store
from hsx_store.export.base import ExportError
from hsx_store.export.run import export, read_exported
from hsx_store.format import IMAGE_ARRAYS, Manifest, Store, StoreFormatError, plan_digest
from hsx_store.images import ImageBlobs, SampleImage, collapse, image_digest
from hsx_store.integrity import verify_store
from hsx_store.location import open_location
from hsx_store.reader import HiddenStatesDataset, HiddenStatesIterable
from tests.helpers.synthetic import NUM_AUX, H, build_store, manifest, new_store, plan

TOKEN = 12  # the image token, as <|image_pad|> in the tiny Qwen2.5-VL
ENCODED = {name: f"\x89PNG image {name}".encode() * (1 + n) for n, name in enumerate("abc")}
DIGEST = {name: image_digest(data) for name, data in ENCODED.items()}
BYTES = {DIGEST[name]: data for name, data in ENCODED.items()}


def image(name: str, start: int, length: int, grid: tuple[int, int, int]) -> SampleImage:
    return SampleImage(DIGEST[name], start, length, grid)


# 6 samples, 2 a shard: images in the first and last shards, image a in three samples.
IDS = [
    [1, TOKEN, TOKEN, TOKEN, TOKEN, 5],
    [3, 4, 5],
    [TOKEN, TOKEN, 7, TOKEN, TOKEN, TOKEN, TOKEN, 9],
    [8, TOKEN, TOKEN],
    [6, 6],
    [TOKEN, TOKEN, TOKEN, TOKEN, 2],
]
IMAGES = [
    [image("a", 1, 4, (1, 4, 4))],
    [],
    [image("b", 0, 2, (1, 2, 4)), image("a", 3, 4, (1, 4, 4))],
    [image("c", 1, 2, (1, 2, 4))],
    [],
    [image("a", 0, 4, (1, 4, 4))],
]
NAMES = [f"v{i}" for i in range(len(IDS))]


def image_manifest(**kw) -> Manifest:
    kw = {"image_token_id": TOKEN, "position_ids": "mrope", "dtype": "float32", **kw}
    return dataclasses.replace(manifest(), samples_per_shard=2, **kw)


def sample_plan() -> tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray]]:
    """ids, loss masks (0 on every image token), positions [P, 3] (distinct per sample)."""
    ids = [np.array(x, np.int32) for x in IDS]
    masks = [(x != TOKEN).astype(np.uint8) for x in ids]
    positions = [np.arange(3 * len(x)).reshape(-1, 3) + 100 * i for i, x in enumerate(ids)]
    return ids, masks, positions


def hidden(i: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(i)
    n = len(IDS[i])
    return rng.standard_normal((n, NUM_AUX, H), np.float32), rng.standard_normal((n, H), np.float32)


def image_store(path: Path, **kw) -> Store:
    """The plan above, every shard written and committed."""
    ids, masks, positions = sample_plan()
    store = create_store(
        path, image_manifest(**kw), NAMES, ids, masks,
        position_ids=positions, images=IMAGES, image_bytes=BYTES,
    )  # fmt: skip
    for shard in store.shards:
        writer = ShardWriter(store, shard)
        for i in range(shard.sample_begin, shard.sample_end):
            writer.write_sample(i, *hidden(i))
        writer.commit({"worker": "test"})
    return store


def assert_image_sample(sample: dict, i: int) -> None:
    ids, masks, positions = sample_plan()
    assert sample["sample_id"] == NAMES[i]
    assert torch.equal(sample["input_ids"], torch.from_numpy(ids[i].astype(np.int64)))
    assert torch.equal(sample["loss_mask"], torch.from_numpy(masks[i].astype(np.int64)))
    assert sample["position_ids"].dtype == torch.int64
    assert torch.equal(sample["position_ids"], torch.from_numpy(positions[i].astype(np.int64)))
    spans = [[im.start, im.length] for im in IMAGES[i]]
    assert sample["image_spans"].dtype == torch.int64
    assert sample["image_spans"].tolist() == spans and sample["image_spans"].shape == (
        len(spans),
        2,
    )
    assert sample["image_grid_thw"].tolist() == [list(im.grid_thw) for im in IMAGES[i]]
    assert sample["image_grid_thw"].shape == (len(spans), 3)
    assert sample["image_digests"] == [im.digest for im in IMAGES[i]]
    assert sample["images"] == [BYTES[im.digest] for im in IMAGES[i]]
    np.testing.assert_array_equal(sample["aux_hidden_states"].numpy(), hidden(i)[0].reshape(-1, 24))


# -- the images themselves ---------------------------------------------------------------------


def test_an_image_is_kept_once_and_a_damaged_or_missing_one_is_refused_by_digest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    puts: list[str] = []
    original = ImageBlobs.put
    monkeypatch.setattr(
        ImageBlobs, "put", lambda self, d, data: (puts.append(d), original(self, d, data))
    )
    store = image_store(tmp_path / "s.zarr")
    assert sorted(puts) == sorted(DIGEST.values())  # a in three samples: put once

    blobs, a = ImageBlobs(store), DIGEST["a"]
    path = tmp_path / "s.zarr" / "images" / a
    assert path.read_bytes() == ENCODED["a"] and blobs.get(a) == ENCODED["a"]
    assert sorted(os.listdir(path.parent)) == sorted(DIGEST.values())  # no temporaries left

    path.write_bytes(b"not the image")
    blobs.put(a, ENCODED["a"])  # present: left as it is (a put only creates)
    with pytest.raises(StoreFormatError, match=f"image {a} is damaged: its bytes have sha256"):
        blobs.get(a)
    path.unlink()
    with pytest.raises(StoreFormatError, match=f"image {a} is missing"):
        blobs.get(a)
    with pytest.raises(ValueError, match="the bytes given have sha256"):
        blobs.put(a, b"other bytes")
    with pytest.raises(ValueError, match="is not a sha256 hex digest"):
        blobs.get("../../zarr.json")


def test_images_on_object_storage_are_created_once_and_checked_when_read() -> None:
    """The object-storage path, on obstore's in-memory store (no server)."""
    memory = obstore.store.MemoryStore()
    group = zarr.open_group(ObjectStore(memory), mode="w", zarr_format=3)
    blobs, a = ImageBlobs(SimpleNamespace(group=group)), DIGEST["a"]
    blobs.put(a, ENCODED["a"])
    assert bytes(obstore.get(memory, f"images/{a}").bytes()) == ENCODED["a"]
    assert blobs.get(a) == ENCODED["a"]
    # From the location alone (a planning task's, without opening the store): the same keys.
    located = ImageBlobs(ObjectStore(memory))
    assert located.get(a) == ENCODED["a"]
    located.put(DIGEST["c"], ENCODED["c"])
    assert blobs.get(DIGEST["c"]) == ENCODED["c"]
    obstore.put(memory, f"images/{a}", b"damaged")
    blobs.put(a, ENCODED["a"])  # there: not sent again
    with pytest.raises(StoreFormatError, match=f"image {a} is damaged"):
        blobs.get(a)
    with pytest.raises(StoreFormatError, match=f"image {DIGEST['b']} is missing"):
        blobs.get(DIGEST["b"])


def test_images_put_at_a_local_location_are_the_stores(tmp_path: Path) -> None:
    url = tmp_path / "s.zarr"
    for location in (open_location(str(url)), url):  # a path, as open_location gives it
        ImageBlobs(location).put(DIGEST["b"], ENCODED["b"])
    assert os.listdir(url / "images") == [DIGEST["b"]]
    store = create_store(
        url, image_manifest(), NAMES[1:2], [np.array(IDS[1], np.int32)], [np.ones(3, np.uint8)],
        position_ids=[sample_plan()[2][1]], overwrite=True,
    )  # fmt: skip
    ImageBlobs(str(url)).put(DIGEST["a"], ENCODED["a"])
    assert ImageBlobs(store).get(DIGEST["a"]) == ENCODED["a"]


def test_collapse_sends_one_image_token_per_image() -> None:
    ids = np.array(IDS[2], np.int32)
    assert collapse(ids, IMAGES[2], TOKEN) == [TOKEN, 7, TOKEN, 9]
    assert collapse(ids, list(reversed(IMAGES[2])), TOKEN) == [TOKEN, 7, TOKEN, 9]
    assert collapse([3, 4], [], TOKEN) == [3, 4]


# -- the table and the positions, round trip -------------------------------------------------


@pytest.mark.parametrize("codec", ["none", "zstd"])  # rows read from the files / through zarr
def test_the_image_table_and_positions_come_back_through_the_store_and_both_readers(
    tmp_path: Path, codec: str
) -> None:
    store = image_store(tmp_path / "s.zarr", codec={"name": codec, "level": 1})
    opened = Store.open(tmp_path / "s.zarr")
    assert opened.manifest.image_token_id == TOKEN and opened.manifest.position_ids == "mrope"
    want = {i: images for i, images in enumerate(IMAGES) if images}
    assert opened.sample_images(0, 6) == want
    assert opened.sample_images(1, 3) == {2: IMAGES[2]} and opened.sample_images(4, 5) == {}
    assert opened.group["image_sample"].shape == (5,)  # trimmed to the images exactly
    np.testing.assert_array_equal(
        opened.group["position_ids"][store.sample_rows(2)], sample_plan()[2][2]
    )

    url = str(tmp_path / "s.zarr")
    ds = HiddenStatesDataset(url)
    assert len(ds) == 6
    for k in range(6):
        assert_image_sample(ds[k], k)
    seen = []
    for sample in HiddenStatesIterable(url, rank=0, world_size=1, block_bytes=1):
        i = NAMES.index(sample["sample_id"])
        assert_image_sample(sample, i)
        seen.append(i)
    assert seen == list(range(6))


def test_dataloader_workers_read_the_images_in_their_own_processes(tmp_path: Path) -> None:
    image_store(tmp_path / "s.zarr")
    it = HiddenStatesIterable(str(tmp_path / "s.zarr"), rank=0, world_size=1)
    seen = []
    for sample in DataLoader(it, batch_size=None, num_workers=2):
        i = NAMES.index(sample["sample_id"])
        assert_image_sample(sample, i)
        seen.append(i)
    assert sorted(seen) == list(range(6))


def test_a_store_read_while_planned_shows_the_images_of_its_planned_shards(tmp_path: Path) -> None:
    ids, masks, positions = sample_plan()
    builder = StoreBuilder.create(tmp_path / "s.zarr", image_manifest())
    for i in range(3):
        builder.add(NAMES[i], ids[i], masks[i], positions[i], IMAGES[i])
    builder.flush()  # shard 0; sample 2 waits in shard 1
    store = Store.open(tmp_path / "s.zarr")
    assert store.sample_images(0, 6) == {0: IMAGES[0]}
    # Grown ahead of need: the rows not written yet sort after every sample.
    assert store.group["image_sample"].shape[0] >= 1


@pytest.mark.parametrize(
    "change,sample,message",
    [
        (dict(position_ids=np.zeros((8, 3), np.int32)), 2, "shard 1: the inputs no longer give"),
        (dict(images=[image("b", 0, 2, (1, 1, 8)), IMAGES[2][1]]), 2, "shard 1: the inputs"),
        (dict(images=[IMAGES[2][0], image("c", 3, 4, (1, 4, 4))]), 2, "shard 1: the inputs"),
        ({}, None, None),  # the same plan again: resumed
    ],
)
def test_a_resume_notices_changed_positions_or_images(
    tmp_path: Path, change: dict, sample: int | None, message: str | None
) -> None:
    ids, masks, positions = sample_plan()
    builder = StoreBuilder.create(tmp_path / "s.zarr", image_manifest())
    for i in range(4):
        builder.add(NAMES[i], ids[i], masks[i], positions[i], IMAGES[i])
    builder.flush()  # shards 0 and 1 planned; then the driver stops
    resumed = StoreBuilder.resume(Store.open(tmp_path / "s.zarr", "r+"))
    for i in range(6):
        given = {"position_ids": positions[i], "images": IMAGES[i]}
        resumed.add(NAMES[i], ids[i], masks[i], **{**given, **(change if i == sample else {})})
    if message is not None:
        with pytest.raises(PlanDiverged, match=message):
            resumed.finish([])
        return
    resumed.finish([])
    store = Store.open(tmp_path / "s.zarr")
    assert store.sample_images(0, 6) == {i: images for i, images in enumerate(IMAGES) if images}


def test_a_resume_leaves_no_image_row_of_an_interrupted_flush_to_a_sample(tmp_path: Path) -> None:
    """An interrupted flush wrote sample 5's image row but not its shard's digest; the plan
    made again gives sample 5 no image: a reader of the shard sees none."""
    ids, masks, positions = sample_plan()
    builder = StoreBuilder.create(tmp_path / "s.zarr", image_manifest())
    for i in range(4):
        builder.add(NAMES[i], ids[i], masks[i], positions[i], IMAGES[i])
    builder.flush()
    g = zarr.open_group(tmp_path / "s.zarr", mode="r+")
    row = 4  # after the 4 images of shards 0 and 1
    for name in IMAGE_ARRAYS:  # as the flush's resize and writes left them
        array = g[name]
        array.resize((max(array.shape[0], row + 1), *array.shape[1:]))
        array[row] = (5, 0, 4, (1, 4, 4), DIGEST["a"])[IMAGE_ARRAYS.index(name)]
    assert Store.open(tmp_path / "s.zarr").sample_images(5, 6) != {}  # what it would read

    resumed = StoreBuilder.resume(Store.open(tmp_path / "s.zarr", "r+"))
    text = np.array([2, 3, 4], np.int32)
    for i in range(4):
        resumed.add(NAMES[i], ids[i], masks[i], positions[i], IMAGES[i])
    resumed.add(NAMES[4], ids[4], masks[4], positions[4])
    resumed.add(NAMES[5], text, np.ones(3, np.uint8), np.zeros((3, 3), np.int32))
    resumed.flush()  # shard 2 planned, the plan not finished
    assert Store.open(tmp_path / "s.zarr").sample_images(4, 6) == {}


@pytest.mark.parametrize(
    "edit,message",
    [
        (dict(position_ids=None), "an M-RoPE store needs its position_ids"),
        (dict(position_ids=np.zeros((6, 2), np.int32)), r"position_ids must be integers \[6, 3\]"),
        (dict(images=[image("a", 3, 4, (1, 4, 4))]), "a span must lie inside the sample's 6 rows"),
        (dict(images=[image("a", 0, 4, (1, 4, 4))]), r"not all image tokens \(12\)"),
        (dict(images=[image("a", 1, 4, (1, 0, 4))]), "is not 3 counts >= 1"),
        (dict(images=[SampleImage("x" * 64, 1, 4, (1, 4, 4))]), "not a sha256 hex digest"),
        (dict(images=[]), r"4 image tokens \(12\) outside every image span \(first: row 1\)"),
        (dict(images=[image("a", 2, 3, (1, 3, 1))]), r"1 image tokens \(12\) outside .* row 1\)"),
        (dict(loss_mask=np.ones(6, np.uint8)), "loss mask 1 on an image token"),
    ],
)
def test_add_refuses_a_sample_whose_images_or_positions_do_not_fit(
    tmp_path: Path, edit: dict, message: str
) -> None:
    ids, masks, positions = sample_plan()
    builder = StoreBuilder.create(tmp_path / "s.zarr", image_manifest())
    given = dict(loss_mask=masks[0], position_ids=positions[0], images=IMAGES[0])
    with pytest.raises(ValueError, match=message) as caught:
        builder.add(NAMES[0], ids[0], **{**given, **edit})
    assert "sample 'v0'" in str(caught.value)


def test_a_text_store_takes_neither_images_nor_positions(tmp_path: Path) -> None:
    builder = StoreBuilder.create(tmp_path / "s.zarr", manifest())
    ids, masks, positions = sample_plan()
    with pytest.raises(ValueError, match="the store holds none"):
        builder.add("v0", ids[0], masks[0], images=IMAGES[0])
    with pytest.raises(ValueError, match="the store keeps none"):
        builder.add("v0", ids[0], masks[0], position_ids=positions[0])


# -- verify ----------------------------------------------------------------------------------


def image_errors(url: Path) -> list[str]:
    report = verify_store(url, say=lambda _: None)
    print(report.format())
    return [f.message for f in report.findings if f.check == "images" and f.level == "error"]


def test_a_good_image_store_verifies(tmp_path: Path) -> None:
    image_store(tmp_path / "s.zarr")
    report = verify_store(tmp_path / "s.zarr", say=lambda _: None)
    assert report.ok, report.format()
    assert report.checks["images"] == "ran"
    assert (report.checked["images_checked"], report.checked["image_blobs_checked"]) == (5, 3)


def test_verify_names_the_sample_of_a_missing_image(tmp_path: Path) -> None:
    image_store(tmp_path / "s.zarr")
    (tmp_path / "s.zarr" / "images" / DIGEST["a"]).unlink()
    errors = image_errors(tmp_path / "s.zarr")
    assert [e.split(": ")[0] for e in errors] == ["sample 0 (v0)", "sample 2 (v2)", "sample 5 (v5)"]
    assert errors[1].startswith("sample 2 (v2): image 1 (rows 3..6 of the sample): ")
    assert all(f"image {DIGEST['a']} is missing" in e for e in errors)


def test_verify_names_a_span_off_the_image_tokens_and_one_trained_on(tmp_path: Path) -> None:
    store = image_store(tmp_path / "s.zarr")
    g = zarr.open_group(tmp_path / "s.zarr", mode="r+")
    g["image_start"][4] = 0  # sample 5's image a: rows 0..3 -> still image tokens
    g["image_start"][3] = 0  # sample 3's image c: rows 0..1, row 0 holds 8
    g["loss_mask"][store.sample_start[0] + 2] = 1  # sample 0's image a
    assert image_errors(tmp_path / "s.zarr") == [
        "sample 0 (v0): image 0 (rows 1..4 of the sample): loss mask 1 on 1 image rows "
        "(first: row 2)",
        "sample 3 (v3): 1 image tokens (12) outside every image span (first: row 2)",
        "sample 3 (v3): image 0 (rows 0..1 of the sample): 1 rows are not the image token 12 "
        "(first: row 0 holds 8)",
        "sample 3 (v3): image 0 (rows 0..1 of the sample): loss mask 1 on 1 image rows "
        "(first: row 0)",  # row 0 is a text token, trained on
    ]
    g["image_length"][0] = 6  # sample 0's image a: past the end of its 6 rows
    assert image_errors(tmp_path / "s.zarr")[0] == (
        "sample 0 (v0): image 0 (rows 1..6 of the sample) lies outside the sample's 6 rows or "
        "before the end of the image before it (row 0)"
    )
    # The table is the plan too: its shard's digest no longer matches.
    report = verify_store(tmp_path / "s.zarr", say=lambda _: None)
    plan_errors = [f.message for f in report.findings if f.check == "plan"]
    assert any(
        "input_ids / loss_mask / position_ids rows and image table" in e for e in plan_errors
    )


def test_verify_names_an_image_token_outside_every_span(tmp_path: Path) -> None:
    """Text holding the image token (a sample without images, or beside one): the model would
    meet an image token without an image."""
    store = image_store(tmp_path / "s.zarr")
    g = zarr.open_group(tmp_path / "s.zarr", mode="r+")
    g["input_ids"][store.sample_start[1] + 2] = TOKEN  # sample 1 has no image
    g["input_ids"][store.sample_start[2] + 2] = TOKEN  # sample 2: between its two images
    assert image_errors(tmp_path / "s.zarr") == [
        "sample 1 (v1): 1 image tokens (12) outside every image span (first: row 2)",
        "sample 2 (v2): 1 image tokens (12) outside every image span (first: row 2)",
    ]
    # A store whose table is empty (text rows on a vision model): every shard is read.
    ids = [np.array([3, 4, 5], np.int32), np.array([6, 7], np.int32)]
    positions = [np.repeat(np.arange(len(x))[:, None], 3, axis=1) for x in ids]
    url = tmp_path / "t.zarr"
    text = create_store(
        url, image_manifest(), ["t0", "t1"], ids, [np.ones(len(x), np.uint8) for x in ids],
        position_ids=positions,
    )  # fmt: skip
    assert image_errors(url) == []
    zarr.open_group(url, mode="r+")["input_ids"][text.sample_start[1] + 1] = TOKEN
    assert image_errors(url) == [
        "sample 1 (t1): 1 image tokens (12) outside every image span (first: row 1)"
    ]


def test_verify_checks_the_position_ids_as_part_of_the_plan(tmp_path: Path) -> None:
    store = image_store(tmp_path / "s.zarr")
    zarr.open_group(tmp_path / "s.zarr", mode="r+")["position_ids"][store.sample_start[3]] = 0
    report = verify_store(tmp_path / "s.zarr", say=lambda _: None)
    assert [f.message.split(":")[0] for f in report.findings] == [
        "shard 1 (samples 2..3 (v2 .. v3))"
    ]
    del zarr.open_group(tmp_path / "s.zarr", mode="r+")["position_ids"]
    report = verify_store(tmp_path / "s.zarr", say=lambda _: None)
    assert "array position_ids is missing" in [f.message for f in report.findings]


# -- export, text stores, schemas ------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["specforge", "speculators"])
def test_an_image_store_is_not_exported(tmp_path: Path, fmt: str) -> None:
    image_store(tmp_path / "s.zarr")
    with pytest.raises(ExportError, match=r"is a store of images \(5 in its samples\): the "):
        export(str(tmp_path / "s.zarr"), tmp_path / "out", fmt, say=lambda _: None)
    assert not (tmp_path / "out").exists()


def test_a_text_plan_on_a_vision_model_exports_as_text(tmp_path: Path) -> None:
    """No image in its table; its M-RoPE positions are three equal aranges, the plain ones."""
    ids = [np.array([3, 4, 5], np.int32), np.array([6, 7], np.int32)]
    masks = [np.ones(len(x), np.uint8) for x in ids]
    positions = [np.repeat(np.arange(len(x))[:, None], 3, axis=1) for x in ids]
    url = tmp_path / "s.zarr"
    store = create_store(url, image_manifest(), ["t0", "t1"], ids, masks, position_ids=positions)
    writer = ShardWriter(store, store.shards[0])
    for i in range(2):
        rng = np.random.default_rng(i)
        n = len(ids[i])
        writer.write_sample(
            i,
            rng.standard_normal((n, NUM_AUX, H), np.float32),
            rng.standard_normal((n, H), np.float32),
        )
    writer.commit({"worker": "test"})
    summary = export(str(url), tmp_path / "out", "specforge", say=lambda _: None)
    assert summary["exported"] == 2
    assert read_exported(tmp_path / "out", "specforge", 1)["input_ids"].tolist() == [6, 7]


TEXT_ARRAYS = {
    "input_ids", "loss_mask", "aux_hidden_states", "final_hidden_states", "sample_start",
    "sample_length", "sample_id", "sample_status", "shard_committed", "shard_summary",
    "shard_plan_sha256",
}  # fmt: skip


def test_a_text_store_is_written_as_before(tmp_path: Path) -> None:
    store = new_store(tmp_path / "s.zarr")
    assert set(store.group.array_keys()) == TEXT_ARRAYS
    assert not (tmp_path / "s.zarr" / "images").exists()
    assert store.manifest.image_token_id is None and store.manifest.position_ids is None
    _, ids, masks = plan()
    shard = store.shards[0]
    rows = np.concatenate(ids[shard.sample_begin : shard.sample_end]).astype(np.int32)
    mask = np.concatenate(masks[shard.sample_begin : shard.sample_end]).astype(np.uint8)
    before = hashlib.sha256(rows.tobytes() + mask.tobytes()).hexdigest()  # the digest as it was
    assert plan_digest(rows, mask) == before == store.group["shard_plan_sha256"][0]
    assert store.sample_images(0, store.num_samples) == {}

    written = build_store(tmp_path / "w.zarr")
    keys = {"sample_id", "input_ids", "loss_mask", "aux_hidden_states", "final_hidden_states"}
    assert set(HiddenStatesDataset(str(written))[0]) == keys
    assert set(next(iter(HiddenStatesIterable(str(written))))) == keys


def test_older_schemas_read_as_text_stores_and_schema_6_fields_are_checked() -> None:
    five = {**manifest().to_json(), "schema_version": 5}
    for field in ("image_token_id", "position_ids"):
        del five[field]
    m = Manifest.from_json(five)
    assert (m.image_token_id, m.position_ids, m.has_images, m.mrope) == (None, None, False, False)
    assert m.to_json() == five
    with pytest.raises(StoreFormatError, match=r"unknown \['image_token_id'\]"):
        Manifest.from_json({**five, "image_token_id": TOKEN})
    six = image_manifest().to_json()
    assert Manifest.from_json(six) == image_manifest()
    with pytest.raises(ValueError, match="position_ids must be 'mrope' or None"):
        Manifest.from_json({**six, "position_ids": "rope"})
    with pytest.raises(ValueError, match="image_token_id must be a token id or None"):
        Manifest.from_json({**six, "image_token_id": True})
