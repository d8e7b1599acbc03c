"""The Zarr v3 store: the product's public data format (schema, layout, opening).

One Zarr v3 group, flat and token-major: sample i owns rows `sample_rows(i)` of every [T, ...]
array. `Manifest` (the group attribute "manifest") is what a reader or a resume needs; `layout`
lays samples out in chunk-aligned work shards; `Store.open` refuses a store of another schema
version (`StoreFormatError`) or one whose creation was interrupted (`StoreIncomplete`). bf16 is
kept as uint16 bits (`BF16_ATTR`), FP8 as uint8 bits beside a scale array (hsx_store/fp8.py).

Every Zarr object has exactly one writer: only the driver writes metadata (array shapes while
planning, attributes); a worker writes only its shard's whole chunks, its `sample_status` chunk
and its own `shard_committed` / `shard_summary` elements.

The schema (arrays, attributes, manifest fields, schema versions, commit rules):
docs/store-format.md.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import obstore.exceptions
import zarr
from zarr.codecs import ZstdCodec

from hsx_store.fp8 import FP8_ATTR, FP8_DTYPE, scale_name
from hsx_store.images import SampleImage
from hsx_store.location import (
    StoreAccessError,
    describe_failure,
    first_key,
    mask_secrets,
    open_location,
)
from hsx_store.model_identity import model_identity
from hsx_store.store_errors import StoreFormatError, StoreIncomplete

# 2: the `created` marker and `shard_plan_sha256`; 3: `weights_fingerprint`; 4: a plan streamed
# into the store (`planned`, arrays grown as shards are planned); 5: `final_states` (the pre-norm
# final state as well as the post-norm one) instead of `final_state`; 6: images
# (`image_token_id`, `position_ids`, the image table and `images/`).
SCHEMA_VERSION = 6
# Read, never written: a schema-2 store reads as one whose weights fingerprint is unknown (None);
# schema 2 and 3 stores were planned whole before `created`; schema 2-4 ones hold the post-norm
# final state only (their `final_state` reads as final_states == [final_state]); schema 2-5
# ones hold text only (image_token_id and position_ids read as None).
READABLE_SCHEMA_VERSIONS = (2, 3, 4, 5, 6)
PER_SAMPLE_BLOCK = 1 << 16  # sample_start / sample_length elements per chunk
PER_SHARD_BLOCK = 1 << 12  # shard_plan_sha256 elements per chunk
BF16_ATTR = {"stored_as": "uint16", "dtype": "bfloat16"}
# Chosen with benchmarks/writer_vs_tofile.py --sweep (2 cores): zstd level 1 compressed bf16
# activations only 1.21x and wrote at 0.4-0.6 GB/s against 1.2-1.8 GB/s uncompressed; per-chunk
# costs (a file, a rename, a zarr call: ~1-2 ms here) want chunks of tens of MB.
DEFAULT_CODEC: dict[str, Any] = {"name": "none"}
CHUNK_TARGET_BYTES = 32 << 20  # aux bytes per chunk


def default_chunk_tokens(num_aux: int, hidden_size: int, itemsize: int = 2) -> int:
    """Rows per chunk: the power of two nearest CHUNK_TARGET_BYTES of aux rows, 256..8192
    (4096 for num_aux 3 x H 1024, 512 for Kimi's 4 x 7168)."""
    rows = CHUNK_TARGET_BYTES / (num_aux * hidden_size * itemsize)
    return int(min(8192, max(256, 2 ** round(np.log2(rows)))))


STATUS_PLANNED, STATUS_WRITTEN, STATUS_FAILED = 0, 1, 2
HIDDEN_ARRAYS = ("aux_hidden_states", "final_hidden_states", "prenorm_hidden_states")
# The final states a store can hold, in this order, and the array holding each.
FINAL_STATE_ARRAYS = {"post_norm": "final_hidden_states", "pre_norm": "prenorm_hidden_states"}
DTYPES = ("bfloat16", "float32", FP8_DTYPE)  # a manifest's dtype: how hidden states are stored
HIDDEN_ITEMSIZE = {"bfloat16": 2, "float32": 4, FP8_DTYPE: 1}
POSITION_IDS = ("mrope",)  # a manifest's position_ids, where not None
# An image store's table: one row per image, in sample order (a sample's in prompt order).
IMAGE_ARRAYS = ("image_sample", "image_start", "image_length", "image_grid_thw", "image_digest")
# image_sample's fill: rows not written yet (a plan still growing) sort after every sample.
NO_IMAGE_SAMPLE = np.iinfo(np.int64).max


@dataclass(frozen=True)
class StoredArray:
    """A token-major array the workers write: a hidden array, or an FP8 store's scales."""

    name: str
    row_shape: tuple[int, ...]  # one token's
    dtype: np.dtype
    attributes: dict[str, Any]

    @property
    def row_bytes(self) -> int:
        return int(np.prod(self.row_shape, dtype=np.int64)) * self.dtype.itemsize


def plan_arrays(manifest: Manifest) -> tuple[str, ...]:
    """The token-major arrays the driver writes: ids, mask and (M-RoPE stores) position ids."""
    return ("input_ids", "loss_mask", *(("position_ids",) if manifest.mrope else ()))


def image_arrays(manifest: Manifest) -> tuple[str, ...]:
    """The image table's arrays (IMAGE_ARRAYS) where the store holds images, else none."""
    return IMAGE_ARRAYS if manifest.has_images else ()


def hidden_row_shape(manifest: Manifest, name: str) -> tuple[int, ...]:
    """One token's shape in hidden array `name`."""
    m = manifest
    return (m.num_aux, m.hidden_size) if name == "aux_hidden_states" else (m.hidden_size,)


def stored_arrays(manifest: Manifest) -> list[StoredArray]:
    """The arrays the workers write, in a fixed order: every hidden array, then (FP8 stores)
    each one's scales."""
    m = manifest
    if m.dtype == FP8_DTYPE:
        u8, f32 = np.dtype(np.uint8), np.dtype(np.float32)
        values = [StoredArray(n, hidden_row_shape(m, n), u8, FP8_ATTR) for n in m.hidden_arrays]
        scales = [
            StoredArray(scale_name(a.name), a.row_shape[:-1], f32, {"scale_of": a.name})
            for a in values
        ]
        return values + scales
    dtype, attrs = (np.uint16, BF16_ATTR) if m.dtype == "bfloat16" else (np.float32, {})
    return [StoredArray(n, hidden_row_shape(m, n), np.dtype(dtype), attrs) for n in m.hidden_arrays]


def open_group(
    url: str | Path, mode: Literal["r", "r+"], storage_options: Mapping[str, Any] | None = None
) -> zarr.Group:
    """The Zarr v3 group at `url`. Raises zarr's GroupNotFoundError (or FileNotFoundError) where
    nothing is, StoreAccessError where the location cannot be used: a missing bucket or refused
    credentials read as "no group" to zarr, so the location is asked directly which it is."""
    location = open_location(url, storage_options, read_only=mode == "r")
    try:
        try:
            return zarr.open_group(store=location, mode=mode, zarr_format=3)
        except zarr.errors.GroupNotFoundError:
            first_key(location)
            raise
        except (ValueError, TypeError) as exc:  # what zarr raises on a zarr.json it cannot parse
            raise damaged_metadata(str(url), exc, storage_options) from None
    except obstore.exceptions.BaseError as exc:
        raise StoreAccessError(describe_failure(url, exc, storage_options)) from None


def damaged_metadata(
    node: str, exc: Exception, storage_options: Mapping[str, Any] | None = None
) -> StoreFormatError:
    """The error for a node (the store, or one of its arrays) whose zarr.json zarr cannot
    read: not JSON, or not the metadata of a Zarr v3 node of its kind."""
    return StoreFormatError(
        mask_secrets(
            f"{node}/zarr.json is damaged: zarr cannot read it as Zarr v3 metadata "
            f"({type(exc).__name__}: {exc})",
            storage_options,
        )
    )


@dataclass(frozen=True)
class Manifest:
    """Everything a reader or a resume needs; kept in the group attributes under "manifest"."""

    schema_version: int
    model: str
    model_config_hash: str  # sha256 of config.json
    tokenizer_hash: str  # sha256 of tokenizer.json
    weights_fingerprint: str | None  # hsx_store/model_identity.py; None: a schema-2 store
    chat_template_hash: str | None
    layer_ids: list[int]  # resolved HF hidden_states indices, ascending
    layer_convention: str
    final_states: list[str]  # ["post_norm"] or ["post_norm", "pre_norm"] (FINAL_STATE_ARRAYS)
    hidden_size: int
    num_aux: int
    dtype: str  # "bfloat16" (stored as uint16 bits), "float32" or "fp8_e4m3" (see the module doc)
    max_length: int
    codec: dict[str, Any]  # {"name": "zstd", "level": 1} or {"name": "none"}
    chunk_tokens: int
    samples_per_shard: int
    # Schema 6; None in older stores and in a text store.
    image_token_id: int | None = None  # the prompt's image token: set in a store of images
    position_ids: str | None = None  # "mrope": the plan keeps each row's 3 M-RoPE positions

    def __post_init__(self) -> None:
        _check_version(self.schema_version)
        if self.schema_version >= 3 and not isinstance(self.weights_fingerprint, str):
            raise ValueError(f"schema {self.schema_version} needs a weights_fingerprint")
        if self.final_states not in (["post_norm"], ["post_norm", "pre_norm"]):
            raise ValueError(
                f"final_states must be ['post_norm'] or ['post_norm', 'pre_norm'], "
                f"got {self.final_states!r}"
            )
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be bfloat16, float32 or {FP8_DTYPE}, got {self.dtype!r}")
        if self.codec.get("name") not in ("zstd", "none"):
            raise ValueError(f"codec must be zstd or none, got {self.codec!r}")
        ids = list(self.layer_ids)
        if ids != sorted(set(ids)) or len(ids) != self.num_aux:
            raise ValueError(f"layer_ids {ids} must be strictly ascending, one per aux slot")
        if min(self.chunk_tokens, self.samples_per_shard, self.hidden_size, self.num_aux) < 1:
            raise ValueError("chunk_tokens, samples_per_shard, hidden_size, num_aux must be >= 1")
        token = self.image_token_id
        if token is not None and (type(token) is not int or token < 0):
            raise ValueError(f"image_token_id must be a token id or None, got {token!r}")
        if self.position_ids is not None and self.position_ids not in POSITION_IDS:
            raise ValueError(f"position_ids must be 'mrope' or None, got {self.position_ids!r}")
        if self.schema_version < 6 and (token is not None or self.position_ids is not None):
            raise ValueError(f"schema {self.schema_version} holds no images or position ids")

    @property
    def hidden_arrays(self) -> tuple[str, ...]:
        """The hidden arrays this store holds: the aux states, then one per final state."""
        return ("aux_hidden_states", *(FINAL_STATE_ARRAYS[s] for s in self.final_states))

    @property
    def has_images(self) -> bool:
        """The store holds an image table (and `images/`)."""
        return self.image_token_id is not None

    @property
    def mrope(self) -> bool:
        """The plan keeps `position_ids` [T, 3]."""
        return self.position_ids == "mrope"

    @property
    def served_dtype(self) -> str:
        """The dtype the model is served (and captured) in: an FP8 store quantizes bf16."""
        return "bfloat16" if self.dtype == FP8_DTYPE else self.dtype

    def to_json(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        if self.schema_version < 5:  # as such a store keeps it (compared with stored copies)
            data["final_state"] = self.final_states[0]
        fields = manifest_fields(self.schema_version)
        return {k: v for k, v in data.items() if k in fields}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Manifest:
        # The version first, so an old reader facing a newer store says so, not "unknown field".
        version = data.get("schema_version") if isinstance(data, Mapping) else None
        _check_version(version)
        names = manifest_fields(version)
        if set(data) != names:
            raise StoreFormatError(
                f"manifest fields differ from schema {version}: "
                f"unknown {sorted(set(data) - names)}, missing {sorted(names - set(data))}"
            )
        fields = dict(data)
        if version < 5:
            fields["final_states"] = [fields.pop("final_state")]
        return cls(
            **{
                "weights_fingerprint": None,  # schema 2 has none
                **fields,
                "layer_ids": list(data["layer_ids"]),
                "final_states": list(fields["final_states"]),
                "codec": dict(data["codec"]),
            }
        )


def manifest_fields(version: int) -> set[str]:
    """The fields a manifest of schema `version` holds."""
    names = {f.name for f in dataclasses.fields(Manifest)}
    if version < 6:
        names -= {"image_token_id", "position_ids"}
    if version < 5:
        names = names - {"final_states"} | {"final_state"}
    return names - {"weights_fingerprint"} if version == 2 else names


def _check_version(version: Any) -> None:
    if version not in READABLE_SCHEMA_VERSIONS:
        raise StoreFormatError(
            f"store schema version {version!r} is not supported: this code reads versions "
            f"{', '.join(map(str, READABLE_SCHEMA_VERSIONS))} (use the matching "
            "hidden-state-extractor release)"
        )


def make_manifest(
    model: str,
    model_dir: str | Path,
    capture: Mapping[str, Any],
    *,
    max_length: int,
    samples_per_shard: int,
    chat_template: str | None = None,
    codec: Mapping[str, Any] = DEFAULT_CODEC,
    chunk_tokens: int | None = None,
    prenorm: bool = True,
    dtype: str | None = None,
    image_token_id: int | None = None,
    position_ids: str | None = None,
) -> Manifest:
    """A manifest with the recommended codec and chunking. `capture` holds the capture fields
    named as in a dump's meta.json (layer_ids, layer_convention, hidden_size, num_aux, dtype),
    so calibration can compare a dump with the manifest key by key. `prenorm`: keep the final
    norm's input too (what vLLM speculators trains on) besides the post-norm state. `dtype`:
    how the store keeps hidden states (FP8_DTYPE, from a bf16 capture); None: as captured.
    `image_token_id`: a store of images (the model's image token); `position_ids`: "mrope"
    where the model positions its rows in 3 M-RoPE sections (the plan keeps them)."""
    model_dir = Path(model_dir)
    num_aux, hidden = int(capture["num_aux"]), int(capture["hidden_size"])
    dtype = dtype or capture["dtype"]
    if dtype == FP8_DTYPE and capture["dtype"] != "bfloat16":
        raise ValueError(f"{FP8_DTYPE} stores quantize a bfloat16 capture, not {capture['dtype']}")
    itemsize = HIDDEN_ITEMSIZE[dtype]
    return Manifest(
        schema_version=SCHEMA_VERSION,
        model=model,
        **model_identity(model_dir),
        chat_template_hash=(
            None if chat_template is None else hashlib.sha256(chat_template.encode()).hexdigest()
        ),
        layer_ids=sorted(int(i) for i in capture["layer_ids"]),
        layer_convention=str(capture["layer_convention"]),
        final_states=["post_norm", "pre_norm"] if prenorm else ["post_norm"],
        hidden_size=hidden,
        num_aux=num_aux,
        dtype=str(dtype),
        max_length=max_length,
        codec=dict(codec),
        chunk_tokens=chunk_tokens or default_chunk_tokens(num_aux, hidden, itemsize),
        samples_per_shard=samples_per_shard,
        image_token_id=None if image_token_id is None else int(image_token_id),
        position_ids=position_ids,
    )


@dataclass(frozen=True)
class Shard:
    """One work shard: samples [sample_begin, sample_end) packed back to back from token_begin
    (a chunk boundary) to token_end (the last sample's end, not padded)."""

    index: int
    sample_begin: int
    sample_end: int
    token_begin: int
    token_end: int


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def layout(
    lengths: Sequence[int] | np.ndarray,
    samples_per_shard: int,
    chunk_tokens: int,
    after: Shard | None = None,
) -> tuple[np.ndarray, list[Shard], int]:
    """Deterministic layout: (sample_start [N] int64, shards, total_rows padded to a chunk).
    Shard k holds samples [k*samples_per_shard, ...), so `sample_status` chunk k is shard k's.
    `after`: the shard these samples follow (a layout continued as a plan grows)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if samples_per_shard < 1 or chunk_tokens < 1:
        raise ValueError("samples_per_shard and chunk_tokens must be >= 1")
    if lengths.size and lengths.min() < 1:
        raise ValueError(f"sample {int(np.argmin(lengths))} has no tokens")
    starts = np.empty(lengths.size, dtype=np.int64)
    shards: list[Shard] = []
    first = after.index + 1 if after else 0
    sample0 = after.sample_end if after else 0
    pos = _round_up(after.token_end, chunk_tokens) if after else 0
    for k, begin in enumerate(range(0, lengths.size, samples_per_shard)):
        end = min(begin + samples_per_shard, lengths.size)
        ends = pos + np.cumsum(lengths[begin:end])
        starts[begin:end] = ends - lengths[begin:end]
        shards.append(Shard(first + k, sample0 + begin, sample0 + end, pos, int(ends[-1])))
        pos = _round_up(int(ends[-1]), chunk_tokens)  # the next shard starts on a chunk boundary
    return starts, shards, pos


def plan_digest(
    input_ids: np.ndarray,
    loss_mask: np.ndarray,
    position_ids: np.ndarray | None = None,
    images: Sequence[tuple[int, SampleImage]] = (),
) -> str:
    """sha256 of a shard's planned rows (int32 ids, then uint8 mask; then, in an image store,
    int32 position ids [rows, 3] and the shard's image table rows, each as (store sample
    index, image)), as `shard_plan_sha256`. A text store's is that of its ids and mask alone."""
    digest = hashlib.sha256(np.ascontiguousarray(input_ids, np.int32).tobytes())
    digest.update(np.ascontiguousarray(loss_mask, np.uint8).tobytes())
    if position_ids is not None:
        digest.update(b"position_ids")
        digest.update(np.ascontiguousarray(position_ids, np.int32).tobytes())
    for sample, im in images:
        t, h, w = im.grid_thw
        digest.update(f"image {sample} {im.start} {im.length} {t} {h} {w} {im.digest};".encode())
    return digest.hexdigest()


def _compressors(codec: Mapping[str, Any]) -> list[ZstdCodec] | None:
    return [ZstdCodec(level=int(codec.get("level", 1)))] if codec["name"] == "zstd" else None


class _Growing:
    """An int64 array appended to in place, its capacity doubling as it grows."""

    def __init__(self, values: np.ndarray) -> None:
        self._data = np.asarray(values, np.int64).copy()
        self._size = len(self._data)

    def extend(self, values: Sequence[int] | np.ndarray) -> None:
        values = np.asarray(values, np.int64)
        need = self._size + len(values)
        if need > len(self._data):
            grown = np.empty(max(need, 2 * len(self._data)), np.int64)
            grown[: self._size] = self._data[: self._size]
            self._data = grown
        self._data[self._size : need] = values
        self._size = need

    @property
    def values(self) -> np.ndarray:
        return self._data[: self._size]


class Store:
    """A thin handle on an existing store, for the driver, the workers and readers. While the
    plan is still being streamed in (`planned` False), it holds the shards planned when it was
    opened; `refresh()` catches up."""

    def __init__(
        self,
        group: zarr.Group,
        manifest: Manifest,
        shards: list[Shard],
        sample_start: np.ndarray,
        sample_length: np.ndarray,
        planned: bool = True,
    ) -> None:
        self.group, self.manifest, self.shards = group, manifest, shards
        self._starts, self._lengths = _Growing(sample_start), _Growing(sample_length)
        self.planned = planned
        self._arrays: dict[str, zarr.Array] = {}

    @classmethod
    def open(
        cls,
        url: str | Path,
        mode: Literal["r", "r+"] = "r",
        storage_options: Mapping[str, Any] | None = None,
    ) -> Store:
        """Raises zarr's GroupNotFoundError where no store is, StoreAccessError where the
        location cannot be used, StoreFormatError for anything else than a store."""
        group = open_group(url, mode, storage_options)
        return cls.from_opened_group(group, group.attrs.asdict(), url)

    @classmethod
    def from_opened_group(
        cls, group: zarr.Group, attrs: Mapping[str, Any], url: str | Path
    ) -> Store:
        """Store.open on a group already opened (and its attributes already read), so a
        caller that looked at them first reads `zarr.json` once."""
        if "manifest" not in attrs:
            raise StoreFormatError(f"{url}: no manifest, not a hidden-state store")
        manifest = Manifest.from_json(attrs["manifest"])  # refuses other schema versions
        if attrs.get("created") is not True:
            raise StoreIncomplete(
                f"{url}: its creation was interrupted before every array was made "
                "(no 'created' marker); no worker has written to it: submit the job again to "
                "create it anew, or delete it"
            )
        planned = manifest.schema_version < 4 or attrs.get("planned") is True
        store = cls(group, manifest, [], np.zeros(0, np.int64), np.zeros(0, np.int64), planned)
        store._read_planned(str(url), planned)
        return store

    @classmethod
    def from_group(cls, group: zarr.Group) -> Store:
        """The handle on a store just created (no shard planned yet)."""
        manifest = Manifest.from_json(group.attrs["manifest"])
        empty = np.zeros(0, np.int64)
        return cls(group, manifest, [], empty, empty.copy(), planned=False)

    def refresh(self) -> None:
        """Catch up with the shards planned since this handle last looked (no-op once the
        plan is complete): reads only what is new, and the arrays' metadata again."""
        if self.planned:
            return
        self._arrays.clear()
        mode = "r" if self.group.store.read_only else "r+"
        self.group = zarr.open_group(store=self.group.store, mode=mode, zarr_format=3)
        planned = self.group.attrs.get("planned") is True
        self._read_planned(str(self.group.store), planned)
        self.planned = planned  # only once read: a failed read leaves it to be tried again

    def _read_planned(self, url: str, planned: bool) -> None:
        """Append the shards planned beyond those this handle holds: those whose
        `shard_plan_sha256` is written (a shard's digest is written after its rows)."""
        done = len(self.shards)
        digests = np.asarray(self.array("shard_plan_sha256")[done:])
        count = int(np.argmin(digests != "")) if (digests == "").any() else len(digests)
        if count == 0:
            return
        n0 = int(self.shards[-1].sample_end) if self.shards else 0
        if planned:
            lengths = np.asarray(self.array("sample_length")[n0:], np.int64)
        else:  # full shards but perhaps the last; unplanned samples read as 0
            lengths = np.asarray(
                self.array("sample_length")[n0 : n0 + count * self.manifest.samples_per_shard],
                np.int64,
            )
            lengths = lengths[: int(np.argmin(lengths > 0)) if (lengths == 0).any() else None]
        after = self.shards[-1] if self.shards else None
        starts, shards, _ = layout(
            lengths, self.manifest.samples_per_shard, self.manifest.chunk_tokens, after
        )
        if len(shards) != count:
            raise StoreFormatError(
                f"{url}: {count} planned shards, but sample_length lays out {len(shards)}"
            )
        # The layout is recomputed, so check it against the stored one rather than trust it.
        if not np.array_equal(starts, self.array("sample_start")[n0 : n0 + len(lengths)]):
            raise StoreFormatError(f"{url}: sample_start disagrees with the layout")
        self.extend(shards, starts, lengths)

    def extend(self, shards: list[Shard], starts: Sequence[int], lengths: Sequence[int]) -> None:
        """Shards planned after this handle's (by the builder, or read by `refresh`). The
        per-sample arrays grow in place, doubling their capacity: extending group by group
        costs O(samples) in all, not O(samples x groups)."""
        self.shards.extend(shards)
        self._starts.extend(starts)
        self._lengths.extend(lengths)

    @property
    def sample_start(self) -> np.ndarray:
        return self._starts.values

    @property
    def sample_length(self) -> np.ndarray:
        return self._lengths.values

    def array(self, name: str) -> zarr.Array:
        """The group's array `name`, opened once per handle: opening reads its metadata (an
        object GET, or a file read), which changes only while the plan grows (`refresh`)."""
        if name not in self._arrays:
            try:
                self._arrays[name] = self.group[name]
            except (ValueError, TypeError) as exc:
                raise damaged_metadata(f"{self.group.store}/{name}", exc) from None
        return self._arrays[name]

    @property
    def num_samples(self) -> int:
        return len(self.sample_length)

    @property
    def job(self) -> dict[str, Any]:
        return dict(self.group.attrs.get("job") or {})  # type: ignore[arg-type]

    @property
    def rejected(self) -> list[dict[str, str]]:
        return list(self.group.attrs["rejected"])  # type: ignore[arg-type]

    def committed(self) -> np.ndarray:
        """Per planned shard (this handle's), whether it is committed."""
        return np.asarray(self.array("shard_committed")[: len(self.shards)]) == 1

    def summary(self, k: int) -> dict[str, Any] | None:
        """Shard k's summary as its writer committed it; None before that."""
        text = str(self.group["shard_summary"][k])
        return json.loads(text) if text else None

    @property
    def holds_images(self) -> bool:
        """Some sample holds an image (a text plan on an image model holds none)."""
        return self.manifest.has_images and self.array("image_sample").shape[0] > 0

    def sample_images(self, begin: int, end: int) -> dict[int, list[SampleImage]]:
        """The images of samples [begin, end) (planned ones), by sample index, each sample's in
        prompt order; samples without images are left out, and a store without images has
        none. One read of `image_sample`, then of the other arrays' rows in range."""
        if not self.manifest.has_images or end <= begin:
            return {}
        # Ascending, and rows not written yet hold NO_IMAGE_SAMPLE: a sorted search finds the
        # range.
        samples = np.asarray(self.array("image_sample")[:])
        lo, hi = np.searchsorted(samples, [begin, end]).tolist()
        if lo == hi:
            return {}
        at = slice(lo, hi)
        starts = np.asarray(self.array("image_start")[at]).tolist()
        lengths = np.asarray(self.array("image_length")[at]).tolist()
        grids = np.asarray(self.array("image_grid_thw")[at]).tolist()
        digests = np.asarray(self.array("image_digest")[at]).tolist()
        images: dict[int, list[SampleImage]] = {}
        for j, i in enumerate(samples[at].tolist()):
            image = SampleImage(str(digests[j]), starts[j], lengths[j], tuple(grids[j]))
            images.setdefault(i, []).append(image)
        return images

    def sample_rows(self, i: int) -> slice:
        start = int(self.sample_start[i])
        return slice(start, start + int(self.sample_length[i]))
