"""Verify a hidden-state store: the checks that need no model. The command is
`python -m cluster verify` (cluster/verify/command.py); the model checks are in cluster/verify/.

Reads the store (never writes it) and reports every problem it finds, each naming the shard,
sample or array concerned, in a VerifyReport (hsx_store/integrity_report.py: its text and exit
status); it stops early only when the store cannot be opened. Checks, each reported OK / FAIL /
SKIP by name: manifest, arrays, layout, commits, plan, images, chunks, values (and recompute,
logprobs when cluster/verify passes them). A failed manifest check makes the store unreadable
and skips the rest. The row scans of the chunks and values checks are hsx_store/row_scan.py's.

What each check proves: docs/using-the-data.md.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import zarr

from hsx_store.format import (
    PER_SAMPLE_BLOCK,
    PER_SHARD_BLOCK,
    READABLE_SCHEMA_VERSIONS,
    STATUS_FAILED,
    STATUS_PLANNED,
    STATUS_WRITTEN,
    Manifest,
    Shard,
    Store,
    StoreFormatError,
    image_arrays,
    layout,
    manifest_fields,
    open_group,
    plan_arrays,
    plan_digest,
    stored_arrays,
)
from hsx_store.fp8 import FP8_DTYPE, scale_name
from hsx_store.images import ImageBlobs, SampleImage, stray_image_token
from hsx_store.integrity_report import CHECKS, VerifyReport
from hsx_store.location import StoreAccessError, describe_failure
from hsx_store.row_scan import BLOCK_BYTES, fp8_row_flags, row_bytes, row_flags, stored_chunk_rows

MANIFEST_TYPES: dict[str, tuple[type, ...]] = {
    "schema_version": (int,),
    "model": (str,),
    "model_config_hash": (str,),
    "tokenizer_hash": (str,),
    "weights_fingerprint": (str,),  # not in schema 2
    "chat_template_hash": (str, type(None)),
    "layer_ids": (list,),
    "layer_convention": (str,),
    "final_state": (str,),  # schema 2-4
    "final_states": (list,),  # schema 5
    "hidden_size": (int,),
    "num_aux": (int,),
    "dtype": (str,),
    "max_length": (int,),
    "codec": (dict,),
    "chunk_tokens": (int,),
    "samples_per_shard": (int,),
    "image_token_id": (int, type(None)),  # schema 6
    "position_ids": (str, type(None)),  # schema 6
}


# Per image_arrays() name: one row's shape and dtype.
IMAGE_ROWS = (((), "int64"), ((), "int32"), ((), "int32"), ((3,), "int32"), ((), "str"))


def _sample_name(ids: np.ndarray, i: int) -> str:
    return f"{i} ({ids[i]})"


def _runs(mask: np.ndarray) -> list[tuple[int, int]]:
    """[start, stop) of each run of True in a 1-d bool array."""
    edges = np.diff(np.concatenate([[0], mask.astype(np.int8), [0]]))
    starts, stops = np.flatnonzero(edges == 1).tolist(), np.flatnonzero(edges == -1).tolist()
    return list(zip(starts, stops, strict=True))


# -- opening: the manifest check -----------------------------------------------------------


def manifest_problems(raw: Any, where: str) -> list[str]:
    """What is wrong with a stored manifest, field by field ([] when Manifest accepts it)."""
    if not isinstance(raw, dict):
        return [f"{where} is not a JSON object: got {type(raw).__name__} {str(raw)[:80]!r}"]
    version = raw.get("schema_version")
    if version not in READABLE_SCHEMA_VERSIONS:
        return [
            f"{where}: schema version {version!r} is not supported: this code reads versions "
            f"{', '.join(map(str, READABLE_SCHEMA_VERSIONS))}"
        ]
    problems = []
    fields = manifest_fields(version)
    missing, unknown = fields - set(raw), set(raw) - fields
    if missing or unknown:
        problems.append(
            f"{where}: fields differ from schema {version}: "
            f"missing {sorted(missing)}, unknown {sorted(unknown)}"
        )
    for key, types in MANIFEST_TYPES.items():
        value = raw.get(key)
        if key in raw and (not isinstance(value, types) or isinstance(value, bool)):
            wanted = " or ".join("null" if t is type(None) else t.__name__ for t in types)
            problems.append(
                f"{where}: field {key} must be {wanted}, got {type(value).__name__} {value!r}"
            )
    ids = raw.get("layer_ids")
    if isinstance(ids, list) and not all(isinstance(i, int) and i >= 0 for i in ids):
        problems.append(f"{where}: field layer_ids must hold non-negative integers, got {ids!r}")
    if isinstance(raw.get("max_length"), int) and raw["max_length"] < 1:
        problems.append(f"{where}: field max_length must be >= 1, got {raw['max_length']}")
    if problems:
        return problems
    try:
        Manifest.from_json(raw)
    except (ValueError, TypeError) as exc:  # Manifest's own value rules
        return [f"{where}: {exc}"]
    return []


def _layout_problems(group: zarr.Group, manifest: Manifest) -> list[str]:
    """Store.open's layout rule, with the samples named: sample_start == layout(lengths)."""
    lengths = np.asarray(group["sample_length"][:], dtype=np.int64)
    empty = np.flatnonzero(lengths < 1)
    if empty.size:
        return [f"sample_length: samples {empty[:10].tolist()} have no tokens (length < 1)"]
    starts, _, _ = layout(lengths, manifest.samples_per_shard, manifest.chunk_tokens)
    stored = np.asarray(group["sample_start"][:])
    if stored.shape != starts.shape:
        return [f"sample_start has shape {stored.shape}, sample_length {lengths.shape}"]
    wrong = np.flatnonzero(stored != starts)
    if wrong.size:
        i = int(wrong[0])
        return [
            f"sample_start disagrees with the deterministic layout at {wrong.size} samples, "
            f"first sample {i}: stored {int(stored[i])}, layout {int(starts[i])}"
        ]
    return []


def _plan_incomplete(attrs: Mapping[str, Any], url: str | Path) -> list[str]:
    """A store still being planned (or whose planning was interrupted) is not verified: its
    arrays are not at their final shapes and its rejects are not all in."""
    version = attrs["manifest"]["schema_version"]
    if version >= 4 and attrs.get("created") is True and attrs.get("planned") is not True:
        return [
            f"{url}: its plan is not complete (no 'planned' marker): the job planning it is "
            "still running or was interrupted (submitting it again finishes the plan)"
        ]
    return []


def open_store(
    url: str | Path, report: VerifyReport, storage_options: Mapping[str, Any] | None = None
) -> Store | None:
    """The store, or None with the reason reported (the store is then unreadable)."""
    where = f"attribute 'manifest' of {url}/zarr.json"
    try:
        group = open_group(url, "r", storage_options)
        attrs = group.attrs.asdict()
    # no bucket, refused credentials, no endpoint; a damaged zarr.json (both name the store)
    except (StoreAccessError, StoreFormatError) as exc:
        problems = [str(exc)]
    except Exception as exc:  # a missing path, unparseable zarr.json, not a group, ...
        problems = [
            f"cannot open as a Zarr v3 group: {describe_failure(url, exc, storage_options)}"
        ]
    else:
        if "manifest" not in attrs:
            problems = [f"{url}/zarr.json has no 'manifest' attribute: not a hidden-state store"]
        else:
            problems = manifest_problems(attrs["manifest"], where)
        if not problems:
            problems = _plan_incomplete(attrs, url)
        if not problems:
            missing = [n for n in ("sample_start", "sample_length") if n not in group]
            problems = [f"{url}: array {n} is missing" for n in missing] or _layout_problems(
                group, Manifest.from_json(attrs["manifest"])
            )
    store = None
    if not problems:
        try:
            store = Store.from_opened_group(group, attrs, url)
        except Exception as exc:
            problems = [f"{url}: Store.open refuses it: {type(exc).__name__}: {exc}"]
    for problem in problems:
        report.error("manifest", problem)
    report.checks["manifest"] = "ran"
    report.unreadable = store is None
    return store


# -- the checks on an open store -----------------------------------------------------------


class _Verifier:
    def __init__(self, store: Store, report: VerifyReport, say: Callable[[str], None]) -> None:
        self.store, self.report, self.say = store, report, say
        self.m = store.manifest
        self.g = store.group
        self.total = layout(store.sample_length, self.m.samples_per_shard, self.m.chunk_tokens)[2]
        self.bad_arrays: set[str] = set()  # arrays the row checks must not read
        self.ids: np.ndarray | None = None
        with contextlib.suppress(Exception):  # a broken sample_id is the arrays check's finding
            self.ids = np.asarray(self.g["sample_id"][:])
        self.status = np.zeros(store.num_samples, np.uint8)
        self.committed: list[Shard] = []  # committed shards, their rows worth checking
        self._images: dict[int, list[SampleImage]] | None = None  # the image table, once read

    def name(self, i: int) -> str:
        return _sample_name(self.ids, i) if self.ids is not None else str(i)

    def span(self, a: int, b: int) -> str:
        """Samples a..b-1 with their ids."""
        if b - a == 1:
            return f"sample {self.name(a)}"
        if self.ids is None:
            return f"samples {a}..{b - 1}"
        return f"samples {a}..{b - 1} ({self.ids[a]} .. {self.ids[b - 1]})"

    def run(self, check: str, fn: Callable[[], str | None]) -> None:
        """Run one check; it returns a skip reason or None. A crash is a finding, not the end."""
        try:
            skipped = fn()
        except Exception as exc:
            self.report.error(check, f"the check crashed: {type(exc).__name__}: {exc}")
            skipped = None
        self.report.checks[check] = f"skipped: {skipped}" if skipped else "ran"

    # -- arrays --

    def expected_arrays(self) -> dict[str, tuple[tuple[int, ...], str, tuple[int, ...]]]:
        m, t, c = self.m, self.total, self.m.chunk_tokens
        n, s = self.store.num_samples, len(self.store.shards)
        # Schema 2-3 stores were written whole: one chunk per array of these.
        streamed = m.schema_version >= 4
        per_sample = (PER_SAMPLE_BLOCK,) if streamed else (max(n, 1),)
        per_shard = (PER_SHARD_BLOCK,) if streamed else (max(s, 1),)
        # The image table's rows: as many as image_sample holds (nothing else says).
        images = self.g["image_sample"].shape[0] if "image_sample" in self.g else 0
        return {
            "input_ids": ((t,), "int32", (c,)),
            "loss_mask": ((t,), "uint8", (c,)),
            **({"position_ids": ((t, 3), "int32", (c, 3))} if m.mrope else {}),
            **{
                a.name: ((t, *a.row_shape), a.dtype.name, (c, *a.row_shape))
                for a in stored_arrays(m)
            },
            "sample_start": ((n,), "int64", per_sample),
            "sample_length": ((n,), "int32", per_sample),
            "sample_id": ((n,), "str", (m.samples_per_shard,)),
            "sample_status": ((n,), "uint8", (m.samples_per_shard,)),
            "shard_committed": ((s,), "uint8", (1,)),
            "shard_summary": ((s,), "str", (1,)),
            "shard_plan_sha256": ((s,), "str", per_shard),
            **{
                name: ((images, *row), dtype, (PER_SAMPLE_BLOCK, *row))
                for name, (row, dtype) in zip(image_arrays(m), IMAGE_ROWS, strict=False)
            },
        }

    def check_arrays(self) -> None:
        m = self.m
        implied = (
            f"(manifest: hidden_size {m.hidden_size}, num_aux {m.num_aux}, dtype {m.dtype}, "
            f"chunk_tokens {m.chunk_tokens}; layout: {self.total} rows, "
            f"{self.store.num_samples} samples, {len(self.store.shards)} shards)"
        )
        for name, (shape, dtype, chunks) in self.expected_arrays().items():
            if name not in self.g:
                self.report.error("arrays", f"array {name} is missing")
                self.bad_arrays.add(name)
                continue
            problems = self.array_problems(self.g[name], name, shape, dtype, chunks)
            if problems:
                self.report.error("arrays", f"{name}: " + "; ".join(problems) + f" {implied}")
                self.bad_arrays.add(name)
        if "sample_id" in self.bad_arrays:
            self.ids = None  # name samples by index only

    def array_problems(
        self, arr: zarr.Array, name: str, shape: tuple, dtype: str, chunks: tuple
    ) -> list[str]:
        problems = []
        if arr.shape != shape:
            problems.append(f"shape {arr.shape} != {shape}")
        kind_ok = arr.dtype.kind in "OTU" if dtype == "str" else arr.dtype == np.dtype(dtype)
        if not kind_ok:
            problems.append(f"dtype {arr.dtype} != {dtype}")
        if arr.chunks != chunks:
            problems.append(f"chunks {arr.chunks} != {chunks}")
        stored = {a.name: a for a in stored_arrays(self.m)}
        if name in stored:
            attrs, wanted = dict(arr.attrs), stored[name].attributes
            if any(attrs.get(k) != v for k, v in wanted.items()) or (
                not wanted and "stored_as" in attrs
            ):
                problems.append(f"attributes {attrs} != {wanted}")
        if name in (*stored, *plan_arrays(self.m)):
            codecs = [type(c).__name__ for c in arr.compressors]
            wanted_codecs = ["ZstdCodec"] if self.m.codec["name"] == "zstd" else []
            if codecs != wanted_codecs:
                problems.append(f"compressors {codecs} != {wanted_codecs} (codec {self.m.codec})")
        return problems

    # -- layout --

    def check_layout(self) -> None:
        m, starts, lengths = self.m, self.store.sample_start, self.store.sample_length
        long = np.flatnonzero(lengths > m.max_length)
        for i in long[:20].tolist():
            self.report.error(
                "layout",
                f"sample {self.name(i)}: length {lengths[i]} > max_length {m.max_length}",
            )
        ends = starts + lengths
        for name in (*plan_arrays(m), *(a.name for a in stored_arrays(m))):
            if name in self.g:
                rows = self.g[name].shape[0]
                outside = np.flatnonzero((starts < 0) | (ends > rows))
                if outside.size:
                    i = int(outside[0])
                    self.report.error(
                        "layout",
                        f"{name}: {outside.size} sample ranges lie outside its {rows} rows, first "
                        f"sample {self.name(i)} rows {starts[i]}..{ends[i] - 1}",
                    )
        order = np.argsort(starts, kind="stable")
        overlap = np.flatnonzero(ends[order][:-1] > starts[order][1:])
        for j in overlap[:20].tolist():
            a, b = int(order[j]), int(order[j + 1])
            self.report.error(
                "layout", f"samples {self.name(a)} and {self.name(b)} overlap at row {starts[b]}"
            )
        self.check_unique_ids()
        for sh in self.store.shards:
            if starts[sh.sample_begin] % m.chunk_tokens:
                self.report.error(
                    "layout",
                    f"shard {sh.index} starts at row {starts[sh.sample_begin]}, not on a chunk "
                    f"boundary (chunk_tokens {m.chunk_tokens})",
                )

    def check_unique_ids(self) -> None:
        """Every sample id names one sample (readers and exports find samples by id)."""
        if self.ids is None:
            return
        ids, counts = np.unique(self.ids, return_counts=True)
        for k in np.flatnonzero(counts > 1)[:20].tolist():
            again = np.flatnonzero(self.ids == ids[k])
            self.report.error(
                "layout",
                f"sample id {str(ids[k])!r} is stored for {counts[k]} samples: "
                + ", ".join(map(str, again[:5].tolist())),
            )

    # -- commits --

    def check_commits(self) -> None:
        unusable = {"sample_status", "shard_committed", "shard_summary"} & self.bad_arrays
        if unusable:
            self.report.error("commits", f"cannot check commits: {sorted(unusable)} unusable")
            return
        self.status = np.asarray(self.g["sample_status"][:])
        marks = np.asarray(self.g["shard_committed"][:])
        summaries = np.asarray(self.g["shard_summary"][:])
        failed: list[dict[str, Any]] = []
        for sh in self.store.shards:
            mark = int(marks[sh.index])
            if mark == 0:
                self.report.error(
                    "commits",
                    f"shard {sh.index} not committed: "
                    f"{self.span(sh.sample_begin, sh.sample_end)} missing",
                )
            elif mark != 1:
                self.report.error(
                    "commits", f"shard {sh.index}: commit marker is {mark}, expected 0 or 1"
                )
            else:
                failed += self.check_committed_shard(sh, str(summaries[sh.index]))
        written = self.status == STATUS_WRITTEN
        in_committed = np.zeros(self.store.num_samples, bool)
        for sh in self.committed:
            in_committed[sh.sample_begin : sh.sample_end] = True
        self.report.checked.update(
            committed_shards=len(self.committed),
            samples_written=int((written & in_committed).sum()),
            samples_failed=len(failed),
            samples_not_committed=int((~in_committed).sum()),
            failed=failed,
        )
        self.record_rejected()

    def check_committed_shard(self, sh: Shard, text: str) -> list[dict[str, Any]]:
        """Statuses and summary of one committed shard; returns its failed samples."""
        self.committed.append(sh)
        status = self.status[sh.sample_begin : sh.sample_end]
        for a, b in _runs(status == STATUS_PLANNED):
            which = self.span(sh.sample_begin + a, sh.sample_begin + b)
            self.report.error(
                "commits",
                f"shard {sh.index} is committed but {which}: status 0 (planned), not written",
            )
        for j in np.flatnonzero(status > STATUS_FAILED).tolist():
            self.report.error(
                "commits",
                f"sample {self.name(sh.sample_begin + j)}: status {status[j]} is not 0, 1 or 2",
            )
        try:
            summary = json.loads(text) if text else None
        except json.JSONDecodeError as exc:
            self.report.error("commits", f"shard {sh.index}: summary is not valid JSON ({exc})")
            summary = None
        if text and summary is not None and not isinstance(summary, dict):
            self.report.error("commits", f"shard {sh.index}: summary is not a JSON object")
            summary = None
        if not text:
            self.report.error("commits", f"shard {sh.index} is committed but has no summary")
        return self.check_summary(sh, status, summary or {}) if summary is not None else []

    def check_summary(
        self, sh: Shard, status: np.ndarray, summary: dict[str, Any]
    ) -> list[dict[str, Any]]:
        k, size = sh.index, sh.sample_end - sh.sample_begin
        reasons = summary.get("failed")
        if not isinstance(reasons, dict):
            self.report.error("commits", f"shard {k}: summary 'failed' is not a dict of reasons")
            reasons = {}
        expected = {
            "shard": k,
            "samples": size,
            "written": int((status == STATUS_WRITTEN).sum()),
        }
        for key, value in expected.items():
            if summary.get(key) != value:
                self.report.error(
                    "commits",
                    f"shard {k}: summary says {key} {summary.get(key)!r}, "
                    f"sample_status says {value}",
                )
        failed, failed_ids = [], set()
        for j in np.flatnonzero(status == STATUS_FAILED).tolist():
            i = sh.sample_begin + j
            sid = str(self.ids[i]) if self.ids is not None else str(i)
            failed_ids.add(sid)
            reason = reasons.get(sid)
            if not isinstance(reason, str) or not reason:
                self.report.error(
                    "commits",
                    f"sample {self.name(i)} has status 2 (failed) but shard {k}'s summary gives "
                    "no reason for it",
                )
            failed.append({"sample": i, "sample_id": sid, "reason": reason, "shard": k})
        for sid in sorted(set(reasons) - failed_ids):
            self.report.error(
                "commits",
                f"shard {k}: summary names {sid!r} as failed, but no sample of the shard with "
                "that id has status 2",
            )
        return failed

    def record_rejected(self) -> None:
        rejected = self.g.attrs.get("rejected")
        ok = isinstance(rejected, list) and all(
            isinstance(r, dict) and {"sample_id", "reason"} <= set(r) for r in rejected
        )
        if not ok:
            self.report.warning(
                "commits", "the 'rejected' attribute is not a list of {sample_id, reason}"
            )
            rejected = []
        self.report.checked["rejected"] = [dict(r) for r in rejected]  # type: ignore[union-attr]

    # -- plan --

    def check_plan(self) -> str | None:
        rows_arrays = list(plan_arrays(self.m))
        unusable = {*rows_arrays, *image_arrays(self.m), "shard_plan_sha256"} & self.bad_arrays
        if unusable:
            return f"{sorted(unusable)} unusable"
        recorded = np.asarray(self.g["shard_plan_sha256"][:])
        planned = " / ".join(rows_arrays) + (
            " rows and image table" if self.m.has_images else " rows"
        )
        images = self.image_table() if self.m.has_images else {}
        for sh in self.committed:
            rows = slice(sh.token_begin, sh.token_end)
            try:
                positions = self.g["position_ids"][rows] if self.m.mrope else None
                shard_images = [
                    (i, im)
                    for i in range(sh.sample_begin, sh.sample_end)
                    for im in images.get(i, [])
                ]
                digest = plan_digest(
                    self.g["input_ids"][rows], self.g["loss_mask"][rows], positions, shard_images
                )
            except Exception:
                if not self.damaged_chunks(rows_arrays, sh):
                    raise
                continue  # named; the other shards are still checked
            if digest != recorded[sh.index]:
                self.report.error(
                    "plan",
                    f"shard {sh.index} ({self.span(sh.sample_begin, sh.sample_end)}): {planned} "
                    f"are not the plan recorded at creation (sha256 "
                    f"{digest[:12]} != {str(recorded[sh.index])[:12]})",
                )
        return None

    # -- images --

    def image_table(self) -> dict[int, list[SampleImage]]:
        """Every sample's images, as the store's table holds them (read once)."""
        if self._images is None:
            self._images = self.store.sample_images(0, self.store.num_samples)
        return self._images

    def check_images(self) -> str | None:
        """An image store's table: rows in sample order, each span inside its sample, after
        the sample's image before it, on image tokens with loss mask 0, its grid 3 counts;
        every image named there stored under its digest; no image token outside every span
        of its sample (text holding the token: the model would meet it without an image).
        Each finding names the sample."""
        if not self.m.has_images:
            return None  # a text store: no image to check
        unusable = {*image_arrays(self.m), "input_ids", "loss_mask"} & self.bad_arrays
        if unusable:
            return f"{sorted(unusable)} unusable"
        samples = np.asarray(self.g["image_sample"][:])
        if samples.size and (
            (np.diff(samples) < 0).any() or samples[0] < 0 or samples[-1] >= self.store.num_samples
        ):
            self.report.error(
                "images",
                f"image_sample is not ascending within the {self.store.num_samples} samples "
                f"(first {samples[:5].tolist()}, last {samples[-5:].tolist()})",
            )
            return None
        blobs, table = ImageBlobs(self.store), self.image_table()
        stored: dict[str, str | None] = {}  # digest -> what is wrong with its blob, if anything
        token = self.m.image_token_id
        assert token is not None
        for sh in self.store.shards:
            rows = slice(sh.token_begin, sh.token_end)  # the shard's plan rows, read once
            ids = np.asarray(self.g["input_ids"][rows])
            held = [i for i in range(sh.sample_begin, sh.sample_end) if i in table]
            if not held and not (ids == token).any():
                continue  # neither an image nor an image token to check
            mask = np.asarray(self.g["loss_mask"][rows])
            for i in range(sh.sample_begin, sh.sample_end):
                at = self.store.sample_rows(i)
                local = slice(at.start - sh.token_begin, at.stop - sh.token_begin)
                if stray := stray_image_token(ids[local], table.get(i, []), token):
                    self.report.error("images", f"sample {self.name(i)}: {stray}")
                for n, im in enumerate(table.get(i, [])):
                    where = (
                        f"sample {self.name(i)}: image {n} (rows {im.start}.."
                        f"{im.start + im.length - 1} of the sample)"
                    )
                    self.check_span(where, im, ids[local], mask[local], table[i][:n])
                    if im.digest not in stored:
                        stored[im.digest] = _blob_problem(blobs, im.digest)
                    if stored[im.digest] is not None:
                        self.report.error("images", f"{where}: {stored[im.digest]}")
        self.report.checked.update(
            images_checked=sum(map(len, table.values())), image_blobs_checked=len(stored)
        )
        return None

    def check_span(
        self,
        where: str,
        im: SampleImage,
        ids: np.ndarray,
        mask: np.ndarray,
        before: list[SampleImage],
    ) -> None:
        """One image's span in its sample's `ids` and `mask` (`before`: the sample's images
        before it)."""
        after = before[-1].start + before[-1].length if before else 0
        if im.length < 1 or im.start < after or im.start + im.length > len(ids):
            self.report.error(
                "images",
                f"{where} lies outside the sample's {len(ids)} rows or before the end of the "
                f"image before it (row {after})",
            )
            return
        span = slice(im.start, im.start + im.length)
        if (other := np.flatnonzero(ids[span] != self.m.image_token_id)).size:
            self.report.error(
                "images",
                f"{where}: {other.size} rows are not the image token {self.m.image_token_id} "
                f"(first: row {im.start + int(other[0])} holds {int(ids[span][other[0]])})",
            )
        if (trained := np.flatnonzero(mask[span])).size:
            self.report.error(
                "images",
                f"{where}: loss mask 1 on {trained.size} image rows (first: row "
                f"{im.start + int(trained[0])})",
            )
        if min(im.grid_thw) < 1:
            self.report.error(
                "images", f"{where}: grid_thw {list(im.grid_thw)} is not 3 counts >= 1"
            )

    # -- chunks --

    def check_chunks(self) -> str | None:
        arrays = [a.name for a in stored_arrays(self.m) if a.name not in self.bad_arrays]
        present = {n: stored_chunk_rows(self.g[n]) for n in arrays}
        if any(p is None for p in present.values()):
            self.report.checked["chunk_listing"] = False
            return "the store cannot list its keys"
        c, checked = self.m.chunk_tokens, 0
        for sh in self.committed:
            for k in range(sh.token_begin // c, -(-sh.token_end // c)):
                checked += 1
                for name in arrays:
                    if not present[name][k]:  # type: ignore[index]
                        self.missing_chunk(name, sh, k)
        self.report.checked.update(chunk_listing=True, chunks_checked=checked * len(arrays))
        return None

    def missing_chunk(self, name: str, sh: Shard, k: int) -> None:
        self.report.error(
            "chunks",
            f"{self.describe_chunk(name, sh, k)} is missing: {self.chunk_samples(name, sh, k)} "
            "read zeros there",
        )

    def damaged_chunks(self, names: list[str], sh: Shard) -> bool:
        """A read of shard sh's rows failed: name every chunk of `names` there that cannot be
        read (a truncated or empty file, bytes its codec refuses), as a "chunks" finding, so
        that the check can go on. False if every chunk reads (the failure is elsewhere)."""
        found = False
        for name in names:
            arr = self.g[name]
            c = arr.chunks[0]
            for k in range(sh.token_begin // c, -(-sh.token_end // c)):
                try:
                    arr[k * c : min((k + 1) * c, arr.shape[0])]
                except Exception as exc:
                    found = True
                    self.report.error(
                        "chunks",
                        f"{self.describe_chunk(name, sh, k)} cannot be read "
                        f"({type(exc).__name__}: {exc}): {self.chunk_samples(name, sh, k)} "
                        "unchecked there",
                    )
        return found

    def describe_chunk(self, name: str, sh: Shard, k: int) -> str:
        arr = self.g[name]
        c = arr.chunks[0]
        key = arr.metadata.encode_chunk_key((k,) + (0,) * (arr.ndim - 1))
        return (
            f"{name}: chunk {k} (key {name}/{key}, rows {k * c}..{(k + 1) * c - 1}) of "
            f"committed shard {sh.index}"
        )

    def chunk_samples(self, name: str, sh: Shard, k: int) -> str:
        """The samples of shard sh with rows in chunk k of `name`."""
        c = self.g[name].chunks[0]
        lo, hi = k * c, (k + 1) * c
        starts = self.store.sample_start[sh.sample_begin : sh.sample_end]
        ends = starts + self.store.sample_length[sh.sample_begin : sh.sample_end]
        first = sh.sample_begin + int(np.searchsorted(ends, lo, side="right"))
        stop = sh.sample_begin + int(np.searchsorted(starts, hi, side="left"))
        return self.span(first, stop)

    # -- values --

    def check_values(self, block_bytes: int = BLOCK_BYTES) -> str | None:
        fp8 = self.m.dtype == FP8_DTYPE
        arrays = [
            n
            for n in self.m.hidden_arrays
            if n not in self.bad_arrays and not (fp8 and scale_name(n) in self.bad_arrays)
        ]
        if self.report.checks.get("commits") != "ran":
            return "the commit check did not run"
        if not arrays:
            return "no usable hidden-state array"
        rows = nbytes = 0
        for sh in self.committed:
            for name in arrays:
                arr, span = self.g[name], (sh.token_begin, sh.token_end)
                try:
                    if fp8:
                        scales = self.g[scale_name(name)]
                        nonfinite, zero = fp8_row_flags(arr, scales, *span, block_bytes)
                    else:
                        nonfinite, zero = row_flags(arr, *span, block_bytes)
                except Exception:
                    if not self.damaged_chunks([name, *([scale_name(name)] if fp8 else [])], sh):
                        raise
                    continue  # named; the other shards and arrays are still checked
                self.report_rows(name, sh, nonfinite, zero)
                rows += sh.token_end - sh.token_begin
                nbytes += (sh.token_end - sh.token_begin) * row_bytes(arr)
        self.report.checked.update(rows_checked=rows, bytes_checked=nbytes)
        return None

    def report_rows(self, name: str, sh: Shard, nonfinite: np.ndarray, zero: np.ndarray) -> None:
        for i in range(sh.sample_begin, sh.sample_end):
            if self.status[i] != STATUS_WRITTEN:
                continue
            rows = self.store.sample_rows(i)
            local = slice(rows.start - sh.token_begin, rows.stop - sh.token_begin)
            bad = np.flatnonzero(nonfinite[local])
            if bad.size:
                self.report.error(
                    "values",
                    f"sample {self.name(i)}: {bad.size} rows of {name} hold non-finite values, "
                    f"first row {rows.start + bad[0]} (token {bad[0]} of the sample)",
                )
            for a, b in _runs(zero[local]):
                self.report.error(
                    "values",
                    f"sample {self.name(i)} rows {rows.start + a}..{rows.start + b - 1} of {name} "
                    "are all zero: chunk missing?",
                )


def _blob_problem(blobs: ImageBlobs, digest: str) -> str | None:
    """What is wrong with image `digest`'s stored bytes (missing, damaged, not a digest)."""
    try:
        blobs.get(digest)
    except (StoreFormatError, ValueError) as exc:
        return str(exc)
    return None


ModelCheckRun = Callable[[Store, VerifyReport], str | None]  # a skip reason or None


def verify_store(
    url: str | Path,
    *,
    recompute: ModelCheckRun | None = None,
    logprobs: ModelCheckRun | None = None,
    storage_options: Mapping[str, Any] | None = None,
    say: Callable[[str], None] = print,
) -> VerifyReport:
    """Run every check on the store at `url` (read only; the checks: docs/using-the-data.md).
    `recompute` and `logprobs` are the checks that need the model (cluster/verify/command.py
    passes them); each returns a skip reason or None, like the others."""
    started = time.monotonic()
    report = VerifyReport(url=str(url))
    store = open_store(url, report, storage_options)
    if store is None:
        for name in CHECKS[1:]:
            report.checks[name] = "skipped: the store cannot be read"
        return report
    report.checked.update(samples=store.num_samples, shards=len(store.shards))
    say(f"verify {url}: {store.num_samples} samples in {len(store.shards)} shards")
    v = _Verifier(store, report, say)
    v.run("arrays", v.check_arrays)
    v.run("layout", v.check_layout)
    v.run("commits", v.check_commits)
    v.run("plan", v.check_plan)
    v.run("images", v.check_images)
    v.run("chunks", v.check_chunks)
    v.run("values", v.check_values)
    v.run(
        "recompute", lambda: recompute(store, report) if recompute else "no --model / --recompute"
    )
    v.run("logprobs", lambda: logprobs(store, report) if logprobs else "no --model / --logprobs")
    report.checked["seconds"] = round(time.monotonic() - started, 2)
    return report
