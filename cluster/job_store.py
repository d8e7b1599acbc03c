"""The job's store: created on the first run and planned into (streamed, while workers capture),
re-opened and checked on a resume.

A resume re-uses the stored plan as it is (sample order, layout, rejects) and never re-reads
the data, unless its planning was interrupted: then it plans again from the start and checks
every shard the store already holds (hsx_store/builder.py). It first proves that the job submitted
now is the job that made the store: same model (config, tokenizer and weights fingerprint),
capture, chunking and plan inputs. Anything that differs is named and refused, because mixing
two jobs' rows in one store would be silent corruption.

A new store is made only once its job is known to plan a sample (planned in this process up to
the first one): a job whose every row is rejected makes none, so a corrected config does not
find a store of "a different job" at its URL. `find_store` makes every check of the location and
of the job that needs no write (`run --dry-run` makes the same ones).
"""

from __future__ import annotations

import os
import re
import shutil
import threading
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import obstore.exceptions
import zarr.errors

from cluster.config import ConfigError, DataConfig, JobConfig
from cluster.images import vision_settings
from cluster.plan import (
    PartEnd,
    PlanError,
    PlanStream,
    Reject,
    Sample,
    chat_template_text,
    source_hashes,
)
from hsx_store.builder import StoreBuilder, require_empty
from hsx_store.format import Manifest, Shard, Store, StoreIncomplete, make_manifest, stored_arrays
from hsx_store.layers import LayerIdsError, ModelConfigError, expected_capture
from hsx_store.location import (
    StoreAccessError,
    describe_failure,
    is_remote,
    open_location,
)

PROJECT_AFTER_PARTS = 8  # planned parts after which the storage estimate is projected
SHOWN_REASONS = 10  # kinds of reject reason a "no usable samples" error lists

# Manifest fields a resume may differ in: where the model lives is not what it is (its hashes),
# and a schema-3 store (planned whole) takes the same rows as a schema-4 one.
RELOCATABLE = {"model", "schema_version"}


class ResumeConflict(ValueError):
    """The store exists but was made by a different job; the message names every difference."""


def job_spec(config: JobConfig, sources_sha256: list[str]) -> dict[str, Any]:
    """What the plan is made from, besides the manifest: stored as the store's `job` attr."""
    # Not what the plan is made from: where images are read and how (credentials among them,
    # which never reach the store).
    how_read = {"image_storage_options", "image_fetch_timeout_s"}
    data = config.data.model_dump(exclude={"paths", "max_length", *how_read})
    # What the responses are made with (not how fast: generate.inflight may change).
    generate = config.generate.model_dump(exclude={"inflight"}) if config.generate else None
    return {"sources_sha256": sources_sha256, **data, "generate": generate}


def manifest_for(config: JobConfig, chat_template: str | None) -> Manifest:
    """Raises ConfigError when model.aux_layer_ids name layers the model does not have."""
    try:
        capture = expected_capture(
            Path(config.model.path), config.model.aux_layer_ids, config.model.dtype
        )
    except LayerIdsError as exc:
        raise ConfigError(f"invalid job config:\n  model.aux_layer_ids: {exc}") from None
    except ModelConfigError as exc:
        raise ConfigError(f"invalid job config:\n  model.path: {exc}") from None
    image_token_id, position_ids = vision_settings(Path(config.model.path))
    codec = {"name": "none"}
    if config.store.codec == "zstd":
        codec = {"name": "zstd", "level": config.store.codec_level}
    return make_manifest(
        config.model.path,
        config.model.path,
        capture,
        max_length=config.data.max_length,
        samples_per_shard=config.store.samples_per_shard,
        chat_template=chat_template,
        codec=codec,
        chunk_tokens=config.store.chunk_tokens,
        prenorm=config.store.prenorm,
        dtype=None if config.store.dtype == "model" else config.store.dtype,
        image_token_id=image_token_id,
        position_ids=position_ids,
    )


def storage_estimate(manifest: Manifest, tokens: int) -> dict[str, int]:
    """Bytes the store will hold, uncompressed (the plan's rows plus the hidden states, an
    FP8 store's scales counted with their hidden array)."""
    estimate = dict.fromkeys(manifest.hidden_arrays, 0)
    for a in stored_arrays(manifest):
        of = a.attributes.get("scale_of", a.name)
        estimate[of] += tokens * a.row_bytes
    return {**estimate, "input_ids_and_loss_mask": tokens * 5}


def describe_capture(manifest: Manifest, store_url: str) -> str:
    finals = ", ".join(manifest.final_states)
    return (
        f"capture: layers {manifest.layer_ids} + final ({finals}), hidden {manifest.hidden_size}, "
        f"{manifest.dtype}, chunks of {manifest.chunk_tokens} tokens, codec {manifest.codec}, "
        f"shards of {manifest.samples_per_shard} samples, into {store_url}"
    )


def describe_estimate(manifest: Manifest, samples: int, tokens: int, store_url: str) -> str:
    estimate = storage_estimate(manifest, tokens)
    total = sum(estimate.values())
    finals = sum(estimate[name] for name in manifest.hidden_arrays[1:])
    shards = -(-samples // manifest.samples_per_shard)
    lines = [
        f"{samples} samples, {tokens:,} tokens, {shards} shards; storage estimate "
        f"{total / 1e9:.3f} GB before compression (aux {estimate['aux_hidden_states'] / 1e9:.3f}"
        f" GB, final states {finals / 1e9:.3f} GB) at {store_url}"
    ]
    local = Path(store_url) if "://" not in store_url else None
    if local is not None:
        parent = next(p for p in [local, *local.parents] if p.exists())
        free = shutil.disk_usage(parent).free
        if free < total:
            lines.append(f"WARNING: only {free / 1e9:.1f} GB free at {parent}")
    return "\n".join(lines)


def describe_plan(
    manifest: Manifest, samples: int, tokens: int, rejected: list[dict[str, str]], store_url: str
) -> str:
    lines = [
        f"plan: {describe_estimate(manifest, samples, tokens, store_url)}",
        f"rejected: {len(rejected)} rows",
    ]
    for r in rejected[:10]:
        lines.append(f"  rejected {r['sample_id']}: {r['reason']}")
    if len(rejected) > 10:
        lines.append(f"  ... and {len(rejected) - 10} more (all kept in the store's `rejected`)")
    return "\n".join(lines)


def open_or_create(config: JobConfig, say: Any = print) -> tuple[Store, bool, StoreBuilder | None]:
    """The job's store, whether it was resumed, and the builder to plan into it (None: its
    plan is complete). Only the empty store is made here: planning streams into it
    (`plan_into`) while workers already capture. Everything that can be refused without a
    write is refused first (`find_store`), so a bad location still fails in seconds."""
    url, options = config.store.url, config.store.storage_options
    found, interrupted = find_store(config)
    if found is not None:
        store = Store.open(url, mode="r+", storage_options=options)  # found read-only
        if not store.planned:
            say(
                f"resume: {url} was being planned ({len(store.shards)} shards so far); planning "
                "again and checking the shards it holds"
            )
            return store, True, StoreBuilder.resume(store)
        done = int(store.committed().sum())
        say(
            f"resume: {url} holds {store.num_samples} planned samples, "
            f"{done}/{len(store.shards)} shards committed; re-using its plan"
        )
        return store, True, None
    if interrupted:  # only a driver writes before `created`: nothing to keep
        say(f"{url}: an earlier creation was interrupted; creating the store anew")
    check_plans_a_sample(config)
    template = chat_template_text(config.data, config.model.path, config.model.trust_remote_code)
    manifest = manifest_for(config, template)
    try:
        builder = StoreBuilder.create(
            url,
            manifest,
            job=job_spec(config, source_hashes(config.data)),
            overwrite=interrupted,
            storage_options=options,
        )
    except (OSError, obstore.exceptions.BaseError) as exc:  # e.g. a key that may list, not PUT
        raise StoreAccessError(describe_failure(url, exc, options)) from None
    say(describe_capture(manifest, url))
    return builder.store, False, builder


def find_store(config: JobConfig) -> tuple[Store | None, bool]:
    """The job's store at `store.url`, opened read-only and proven to be this job's
    (ResumeConflict names every difference), or None where a new one is to be made, with
    whether an earlier creation was interrupted there (it is made anew). Writes nothing and
    needs no Ray: `run` refuses here, in seconds, what `run --dry-run` reports."""
    if not Path(config.model.path).is_dir():
        raise ConfigError(
            f"invalid job config:\n  model.path: {config.model.path} is not a directory (a "
            "local model: config.json, the tokenizer and the weights)"
        )
    store, interrupted = probe_location(config.store.url, config.store.storage_options)
    if store is not None:
        check_resume(store, config)
    return store, interrupted


def probe_location(url: str, options: dict[str, Any]) -> tuple[Store | None, bool]:
    """The store at `url` opened read-only, or None where a new one can be made, with whether
    an earlier creation was interrupted there. Raises StoreAccessError naming the URL and why
    it cannot take a store: a file, a local directory this process may not write in, a
    location holding something else, refused credentials; StoreFormatError for a Zarr group
    that is not a store. Object storage cannot tell a key that may list but not PUT without a
    write: that one is refused when the store is made."""
    if not is_remote(url):
        check_local_location(Path(url.removeprefix("file://")), url)
    try:
        return Store.open(url, mode="r", storage_options=options), False
    except (FileNotFoundError, zarr.errors.GroupNotFoundError, zarr.errors.NodeTypeValidationError):
        pass
    except StoreIncomplete:
        return None, True
    # as StoreBuilder.create refuses it, before any planning here
    require_empty(open_location(url, options, read_only=True), url, options)
    return None, False


def check_local_location(path: Path, url: str) -> None:
    """A local store is a directory: `path`, or the folders made for it under its nearest
    existing ancestor, which this process must be able to write in."""
    existing = next(p for p in [path, *path.parents] if p.exists())
    if not existing.is_dir():
        what = "it" if existing == path else str(existing)
        raise StoreAccessError(f"{url}: {what} is a file; a store is a directory")
    if not os.access(existing, os.W_OK | os.X_OK):  # a read-only mount or an immutable folder too
        raise StoreAccessError(f"{url}: {existing} is not writable by this process")


def check_plans_a_sample(config: JobConfig) -> None:
    """Plan in this process up to the job's first accepted sample (the first part, most often):
    raises the PlanError of `no_usable_samples` where every row is rejected."""
    stream = PlanStream(
        config.data, config.model.path, config.model.trust_remote_code, 0, config.generate
    )
    rejected: list[dict[str, str]] = []
    for item in stream:
        if isinstance(item, Sample):
            return
        if isinstance(item, Reject):
            rejected.append(item.to_json())
    raise no_usable_samples(rejected, "rows")


def no_usable_samples(rejected: list[dict[str, str]], what: str) -> PlanError:
    """The error of a job whose every row (`what`) was rejected, with its reasons: grouped by
    kind (the reason with its numbers left out), the commonest first, each with its count and
    its first row's id and reason."""
    kinds: Counter[str] = Counter()
    first: dict[str, dict[str, str]] = {}
    for r in rejected:
        kind = re.sub(r"\d+", "#", r["reason"])
        kinds[kind] += 1
        first.setdefault(kind, r)
    lines = [f"no usable samples: all {len(rejected)} {what} were rejected"]
    for kind, count in kinds.most_common(SHOWN_REASONS):
        lines.append(f"  {count} x, first {first[kind]['sample_id']}: {first[kind]['reason']}")
    if len(kinds) > SHOWN_REASONS:
        rest = sum(count for _, count in kinds.most_common()[SHOWN_REASONS:])
        lines.append(f"  ... and {rest} more, of {len(kinds) - SHOWN_REASONS} other kinds")
    return PlanError("\n".join(lines))


def plan_into(
    builder: StoreBuilder,
    config: JobConfig,
    planners: int | None,
    on_shards: Callable[[list[Shard]], None],
    say: Any = print,
    stop: threading.Event | None = None,
) -> None:
    """Plan the job's data into the store, handing each group of shards to `on_shards` as it
    becomes visible (the queue), and the storage estimate to `say` (projected early, exact at
    the end). `planners`: as PlanStream's (0: in this process; None: every CPU of the nodes
    that hold the data). Setting `stop` ends it before its next store write."""
    stream = PlanStream(
        config.data,
        config.model.path,
        config.model.trust_remote_code,
        planners=planners,
        images_to=(config.store.url, config.store.storage_options),
    )
    rejected: list[dict[str, str]] = []
    # Parts are of about equal size: a few of them project the whole early, before capture
    # has written much (the exact estimate follows at the end).
    project_at = min(PROJECT_AFTER_PARTS, len(stream.parts) - 1)
    for item in stream:
        if stop is not None and stop.is_set():  # the job ended first: the store stays unplanned
            return
        if isinstance(item, Reject):
            rejected.append(item.to_json())
            continue
        if isinstance(item, PartEnd):  # the stream may wait on a slow part: planned ones go out
            shards = builder.flush()
            if stream.parts_done == project_at:
                scale = len(stream.parts) / stream.parts_done
                projected = (round(stream.accepted * scale), round(stream.tokens * scale))
                say(
                    f"plan, projected from its first {stream.parts_done} of {len(stream.parts)} "
                    f"parts: {describe_estimate(builder.m, *projected, config.store.url)}"
                )
        else:
            shards = builder.add(
                item.sample_id,
                item.input_ids,
                item.loss_mask,
                item.position_ids,
                item.images,
            )
        if shards:
            on_shards(shards)
    if not stream.accepted:
        raise no_usable_samples(rejected, "rows")
    if shards := builder.finish(rejected):
        on_shards(shards)
    where = f" on {len(stream.nodes)} node(s)" if stream.nodes else " in the driver"
    say(
        describe_plan(builder.m, stream.accepted, stream.tokens, rejected, config.store.url)
        + f"\nplanned {len(stream.parts)} parts{where}"
    )


def changed_sources(paths: list[str], planned: list[str] | None, now: list[str]) -> list[str]:
    """Each input file whose bytes differ from those the store was planned from, by name."""
    if planned is None or len(planned) != len(now):
        return [f"data.paths: the store was planned from other files ({len(planned or [])})"]
    return [
        f"{path}: changed since the store was planned (sha256 {old[:12]}... now {new[:12]}...)"
        for path, old, new in zip(paths, planned, now, strict=True)
        if old != new
    ]


def check_resume(store: Store, config: JobConfig) -> None:
    stored = store.manifest
    if stored.weights_fingerprint is None:
        raise ResumeConflict(
            f"{config.store.url} has store schema {stored.schema_version}, made by an earlier "
            "release that recorded no weights fingerprint: which checkpoint made it cannot be "
            "checked, so this release does not extend it (finish it with that release, or use a "
            "new store.url; reading, verifying and exporting it work as before)"
        )
    template = chat_template_text(config.data, config.model.path, config.model.trust_remote_code)
    wanted = manifest_for(config, template)
    if stored.schema_version < 6 and wanted.image_token_id is not None:
        raise ResumeConflict(
            f"{config.store.url} has store schema {stored.schema_version}, made before images "
            "were captured: it keeps no image table (nor M-RoPE positions) for this image "
            "model, so this release does not extend it (finish it with that release, or use a "
            "new store.url; reading, verifying and exporting it work as before)"
        )
    problems = [
        f"{key}: store {getattr(stored, key)!r} != config {getattr(wanted, key)!r}"
        for key in wanted.to_json()
        if key not in RELOCATABLE and getattr(stored, key) != getattr(wanted, key)
    ]
    spec = job_spec(config, source_hashes(config.data))
    for key, value in spec.items():
        # A field newer than the store ran as its default: a data field's (tools_field,
        # row_schema, ...), or null for `generate`.
        field = DataConfig.model_fields.get(key)
        stored = store.job.get(key, None if field is None else field.default)
        if stored == value:
            continue
        if key == "sources_sha256":
            problems += changed_sources(config.data.paths, stored, value)
        else:
            section = "" if key == "generate" else "data."
            problems.append(f"{section}{key}: store {stored!r} != config {value!r}")
    if problems:
        raise ResumeConflict(
            f"{config.store.url} was made by a different job; refusing to resume it "
            "(use a new store.url, or submit the original config):\n  " + "\n  ".join(problems)
        )
