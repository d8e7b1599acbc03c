"""The Zarr v3 store: the product's public data format (schema, layout, creation, opening).

One Zarr v3 group, flat and token-major; sample i owns rows `sample_rows(i)` of each [T, ...]:

| array | shape, dtype | chunks | written by |
|---|---|---|---|
| `input_ids` | [T] int32 | chunk_tokens | driver |
| `loss_mask` | [T] uint8 | chunk_tokens | driver |
| `aux_hidden_states` | [T, num_aux, H] uint16 (bf16 bits) / float32 | chunk_tokens | workers |
| `final_hidden_states` | [T, H] same | chunk_tokens | workers |
| `sample_start` | [N] int64 | N | driver |
| `sample_length` | [N] int32 | N | driver |
| `sample_id` | [N] string (variable-length UTF-8) | samples_per_shard | driver |
| `sample_status` | [N] uint8: 0 planned, 1 written, 2 failed | samples_per_shard | workers |
| `shard_committed` | [S] uint8: 1 once the shard's rows are complete | 1 | workers |
| `shard_summary` | [S] string (JSON per shard; "" until committed) | 1 | workers |
| `shard_plan_sha256` | [S] string: sha256 of the shard's planned ids + mask rows | S | driver |

Creation commits last: the group attribute `created` is written after every array and plan row,
so a store whose creation was interrupted (no `created`) is never opened as a plan (`Store.open`
raises `StoreIncomplete`; the driver creates it again, nothing else can have written to it).

Group attributes: `manifest` (`Manifest.to_json()`), `rejected` (plan-time rejects,
`[{"sample_id", "reason"}]`), `job` (what the plan was made from: data sources and their
sha256, plan options; resume compares it) and, written by the driver once a run ends,
`report` (the final report of the latest run). bf16 has no Zarr 3.1 dtype, so hidden states
keep their raw bits in uint16 with the attribute `BF16_ATTR`; view them back with
`ml_dtypes.bfloat16` or torch.

Concurrency: the driver creates every array and attribute before any worker starts; a worker then
writes only its shard's chunks (whole chunks, token ranges are chunk-aligned), its one
`sample_status` chunk and its own `shard_committed` / `shard_summary` elements, so every Zarr
object has exactly one writer and nobody resizes or writes attributes afterwards. Rows that are
never written (padding, failed samples) read back as zero and, being all fill value, are not stored.
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

from store.location import StoreAccessError, describe_failure, first_key, open_location
from store.model_identity import model_identity

SCHEMA_VERSION = 3  # 2: the `created` marker and `shard_plan_sha256`; 3: `weights_fingerprint`
# Read, never written: a schema-2 store reads as one whose weights fingerprint is unknown (None).
READABLE_SCHEMA_VERSIONS = (2, 3)
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
HIDDEN_ARRAYS = ("aux_hidden_states", "final_hidden_states")


class StoreFormatError(ValueError):
    """The store is not one this code can read (wrong schema version, not a store, inconsistent)."""


class StoreIncomplete(StoreFormatError):
    """The store's creation was interrupted: its plan rows are not all written."""


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
    except obstore.exceptions.BaseError as exc:
        raise StoreAccessError(describe_failure(url, exc, storage_options)) from None


@dataclass(frozen=True)
class Manifest:
    """Everything a reader or a resume needs; kept in the group attributes under "manifest"."""

    schema_version: int
    model: str
    model_config_hash: str  # sha256 of config.json
    tokenizer_hash: str  # sha256 of tokenizer.json
    weights_fingerprint: str | None  # store/model_identity.py; None: a schema-2 store
    chat_template_hash: str | None
    layer_ids: list[int]  # resolved HF hidden_states indices, ascending
    layer_convention: str
    final_state: str  # "post_norm"
    hidden_size: int
    num_aux: int
    dtype: str  # "bfloat16" (stored as uint16 bits) or "float32"
    max_length: int
    codec: dict[str, Any]  # {"name": "zstd", "level": 1} or {"name": "none"}
    chunk_tokens: int
    samples_per_shard: int

    def __post_init__(self) -> None:
        _check_version(self.schema_version)
        if self.schema_version >= 3 and not isinstance(self.weights_fingerprint, str):
            raise ValueError(f"schema {self.schema_version} needs a weights_fingerprint")
        if self.dtype not in ("bfloat16", "float32"):
            raise ValueError(f"dtype must be bfloat16 or float32, got {self.dtype!r}")
        if self.codec.get("name") not in ("zstd", "none"):
            raise ValueError(f"codec must be zstd or none, got {self.codec!r}")
        if list(self.layer_ids) != sorted(self.layer_ids) or len(self.layer_ids) != self.num_aux:
            raise ValueError(f"layer_ids {self.layer_ids} must be ascending, one per aux slot")
        if min(self.chunk_tokens, self.samples_per_shard, self.hidden_size, self.num_aux) < 1:
            raise ValueError("chunk_tokens, samples_per_shard, hidden_size, num_aux must be >= 1")

    def to_json(self) -> dict[str, Any]:
        fields = manifest_fields(self.schema_version)
        return {k: v for k, v in dataclasses.asdict(self).items() if k in fields}

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
        return cls(
            **{
                "weights_fingerprint": None,  # schema 2 has none
                **data,
                "layer_ids": list(data["layer_ids"]),
                "codec": dict(data["codec"]),
            }
        )


def manifest_fields(version: int) -> set[str]:
    """The fields a manifest of schema `version` holds."""
    names = {f.name for f in dataclasses.fields(Manifest)}
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
) -> Manifest:
    """A manifest with the recommended codec and chunking. `capture` holds the capture fields
    named as in a dump's meta.json (layer_ids, layer_convention, final_state, hidden_size,
    num_aux, dtype), so calibration can compare a dump with the manifest key by key."""
    model_dir = Path(model_dir)
    num_aux, hidden, dtype = int(capture["num_aux"]), int(capture["hidden_size"]), capture["dtype"]
    itemsize = 2 if dtype == "bfloat16" else 4
    return Manifest(
        schema_version=SCHEMA_VERSION,
        model=model,
        **model_identity(model_dir),
        chat_template_hash=(
            None if chat_template is None else hashlib.sha256(chat_template.encode()).hexdigest()
        ),
        layer_ids=sorted(int(i) for i in capture["layer_ids"]),
        layer_convention=str(capture["layer_convention"]),
        final_state=str(capture["final_state"]),
        hidden_size=hidden,
        num_aux=num_aux,
        dtype=str(dtype),
        max_length=max_length,
        codec=dict(codec),
        chunk_tokens=chunk_tokens or default_chunk_tokens(num_aux, hidden, itemsize),
        samples_per_shard=samples_per_shard,
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
    lengths: Sequence[int] | np.ndarray, samples_per_shard: int, chunk_tokens: int
) -> tuple[np.ndarray, list[Shard], int]:
    """Deterministic layout: (sample_start [N] int64, shards, total_rows padded to a chunk).
    Shard k holds samples [k*samples_per_shard, ...), so `sample_status` chunk k is shard k's."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if samples_per_shard < 1 or chunk_tokens < 1:
        raise ValueError("samples_per_shard and chunk_tokens must be >= 1")
    if lengths.size and lengths.min() < 1:
        raise ValueError(f"sample {int(np.argmin(lengths))} has no tokens")
    starts = np.empty(lengths.size, dtype=np.int64)
    shards: list[Shard] = []
    pos = 0
    for k, begin in enumerate(range(0, lengths.size, samples_per_shard)):
        end = min(begin + samples_per_shard, lengths.size)
        ends = pos + np.cumsum(lengths[begin:end])
        starts[begin:end] = ends - lengths[begin:end]
        shards.append(Shard(k, begin, end, pos, int(ends[-1])))
        pos = _round_up(int(ends[-1]), chunk_tokens)  # the next shard starts on a chunk boundary
    return starts, shards, pos


def plan_digest(input_ids: np.ndarray, loss_mask: np.ndarray) -> str:
    """sha256 of a shard's planned rows (int32 ids, then uint8 mask), as `shard_plan_sha256`."""
    digest = hashlib.sha256(np.ascontiguousarray(input_ids, np.int32).tobytes())
    digest.update(np.ascontiguousarray(loss_mask, np.uint8).tobytes())
    return digest.hexdigest()


def _compressors(codec: Mapping[str, Any]) -> list[ZstdCodec] | None:
    return [ZstdCodec(level=int(codec.get("level", 1)))] if codec["name"] == "zstd" else None


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
    """The driver's one-time creation of every array and attribute, and the plan's own rows;
    the `created` marker last. `job`: what the plan was made from, kept for resume checks.
    Fails if something already exists there (resume opens the store instead), unless
    `overwrite` (for a store whose creation was interrupted)."""
    if not len(sample_ids) == len(input_ids) == len(loss_masks):
        raise ValueError("sample_ids, input_ids and loss_masks differ in length")
    lengths = np.array([len(x) for x in input_ids], dtype=np.int64)
    for i, (ids, mask) in enumerate(zip(input_ids, loss_masks, strict=True)):
        if len(mask) != len(ids) or len(ids) > manifest.max_length:
            raise ValueError(f"sample {sample_ids[i]!r}: bad length or loss mask length")
    starts, shards, total = layout(lengths, manifest.samples_per_shard, manifest.chunk_tokens)
    m, c = manifest, manifest.chunk_tokens
    attrs = {
        "manifest": m.to_json(),
        "rejected": [dict(r) for r in rejected],
        "job": dict(job or {}),
    }
    location = open_location(url, storage_options)
    if not overwrite:
        try:
            existing = first_key(location)
        except obstore.exceptions.BaseError as exc:  # no bucket, refused credentials, ...
            raise StoreAccessError(describe_failure(url, exc, storage_options)) from None
        if existing is not None:
            raise StoreAccessError(
                f"{url}: not empty (it holds {existing!r}): a new store needs an empty location"
            )
    group = zarr.create_group(store=location, zarr_format=3, attributes=attrs, overwrite=overwrite)
    comp = _compressors(m.codec)
    hidden = "uint16" if m.dtype == "bfloat16" else "float32"
    hidden_attrs = BF16_ATTR if m.dtype == "bfloat16" else {}
    n, s = len(lengths), len(shards)

    def new(name: str, shape: tuple[int, ...], dtype: Any, chunks: tuple[int, ...], **kw: Any):
        return group.create_array(
            name, shape=shape, dtype=dtype, chunks=chunks, fill_value=kw.pop("fill", 0), **kw
        )

    ids_arr = new("input_ids", (total,), "int32", (c,), compressors=comp)
    mask_arr = new("loss_mask", (total,), "uint8", (c,), compressors=comp)
    for name, shape in (
        ("aux_hidden_states", (total, m.num_aux, m.hidden_size)),
        ("final_hidden_states", (total, m.hidden_size)),
    ):
        new(name, shape, hidden, (c, *shape[1:]), compressors=comp, attributes=hidden_attrs)
    whole = (max(n, 1),)
    new("sample_start", (n,), "int64", whole)[:] = starts
    new("sample_length", (n,), "int32", whole)[:] = lengths
    per_shard = (m.samples_per_shard,)  # a worker reads its shard's ids in one chunk
    new("sample_id", (n,), str, per_shard, fill="")[:] = np.array(sample_ids, dtype=str)
    new("sample_status", (n,), "uint8", per_shard)
    new("shard_committed", (s,), "uint8", (1,))
    new("shard_summary", (s,), str, (1,), fill="")
    digests = new("shard_plan_sha256", (s,), str, (max(s, 1),), fill="")
    # The plan's rows, one shard range at a time: whole chunks, bounded memory.
    shard_digests = []
    for sh in shards:
        stop = _round_up(sh.token_end, c)
        ids = np.zeros(stop - sh.token_begin, np.int32)
        mask = np.zeros(stop - sh.token_begin, np.uint8)
        for i in range(sh.sample_begin, sh.sample_end):
            rows = slice(starts[i] - sh.token_begin, starts[i] - sh.token_begin + lengths[i])
            ids[rows], mask[rows] = input_ids[i], loss_masks[i]
        ids_arr[sh.token_begin : stop] = ids
        mask_arr[sh.token_begin : stop] = mask
        used = sh.token_end - sh.token_begin
        shard_digests.append(plan_digest(ids[:used], mask[:used]))
    digests[:] = np.array(shard_digests, dtype=str)
    group.attrs["created"] = True  # the creation's commit: everything above is in
    return Store(group, manifest, shards, starts, lengths)


class Store:
    """A thin handle on an existing store, for the driver, the workers and readers."""

    def __init__(
        self,
        group: zarr.Group,
        manifest: Manifest,
        shards: list[Shard],
        sample_start: np.ndarray,
        sample_length: np.ndarray,
    ) -> None:
        self.group, self.manifest, self.shards = group, manifest, shards
        self.sample_start, self.sample_length = sample_start, sample_length
        self._arrays: dict[str, zarr.Array] = {}

    @classmethod
    def open(
        cls,
        url: str | Path,
        mode: Literal["r", "r+"] = "r",
        storage_options: Mapping[str, Any] | None = None,
    ) -> Store:
        """Raises zarr's GroupNotFoundError where no store is, StoreAccessError where the
        location cannot be used, StoreFormatError for anything else than a complete store."""
        group = open_group(url, mode, storage_options)
        attrs = group.attrs.asdict()
        if "manifest" not in attrs:
            raise StoreFormatError(f"{url}: no manifest, not a hidden-state store")
        manifest = Manifest.from_json(attrs["manifest"])  # refuses other schema versions
        if attrs.get("created") is not True:
            raise StoreIncomplete(
                f"{url}: its creation was interrupted before every plan row was written "
                "(no 'created' marker); no worker has written to it: submit the job again to "
                "create it anew, or delete it"
            )
        lengths = np.asarray(group["sample_length"][:], dtype=np.int64)
        starts, shards, _ = layout(lengths, manifest.samples_per_shard, manifest.chunk_tokens)
        # The layout is recomputed, so check it against the stored one rather than trust it.
        if not np.array_equal(starts, group["sample_start"][:]):
            raise StoreFormatError(f"{url}: sample_start disagrees with the layout")
        return cls(group, manifest, shards, starts, lengths)

    def array(self, name: str) -> zarr.Array:
        """The group's array `name`, opened once per handle: opening reads its metadata (an
        object GET, or a file read), and no array's metadata changes after creation."""
        if name not in self._arrays:
            self._arrays[name] = self.group[name]
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
        return np.asarray(self.group["shard_committed"][:]) == 1

    def summary(self, k: int) -> dict[str, Any] | None:
        """Shard k's summary as its writer committed it; None before that."""
        text = str(self.group["shard_summary"][k])
        return json.loads(text) if text else None

    def sample_rows(self, i: int) -> slice:
        start = int(self.sample_start[i])
        return slice(start, start + int(self.sample_length[i]))
