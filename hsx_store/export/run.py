"""An export by format name: `export` walks a store's committed, written samples (following a
running job's shards as they commit, if asked) and hands each to its format; `sample_path` and
`read_exported` find and read back what it wrote."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import zarr

from hsx_store.export.base import ExportError
from hsx_store.export.files import exclusive, fsync_dir, remove_temporaries, write_atomic
from hsx_store.export.record import begin, exported_ids, write_doc
from hsx_store.export.registry import trainer_format
from hsx_store.format import Store
from hsx_store.location import StoreAccessError
from hsx_store.reader import HiddenStatesIterable, bound_attributes, check_same_store

PROGRESS_EVERY_S = 30.0


def sample_path(out_dir: str | Path, fmt: str, index: int) -> Path:
    """Where sample `index` (the store's global sample index) of a `fmt` export lives."""
    return trainer_format(fmt).sample_path(Path(out_dir), index)


def export(
    url: str,
    out_dir: str | Path,
    fmt: str,
    *,
    storage_options: Mapping[str, Any] | None = None,
    allow_post_norm: bool = False,
    say: Callable[[str], Any] = print,
    follow: bool = False,
    poll_s: float = 2.0,
    idle_timeout_s: float | None = 1800.0,
) -> dict[str, Any]:
    """Export every committed, written sample of the store at `url` into `out_dir` in `fmt`
    (both layouts: docs/using-the-data.md). Resumable: a sample whose file exists is
    skipped. `allow_post_norm`: speculators only, write a store's post-norm final state in
    the last slot when it has no pre-norm one (refused otherwise). `follow`: export a running
    job's shards as they commit (a follow reader: hsx_store/reader.py), after waiting for its
    plan to complete; it ends as the reader does, `ended` says why. Returns {format, out_dir,
    exported (written this run), skipped (already there), files (sample files the export now
    holds), bytes (written this run), seconds, removed_temporaries, ended}."""
    kind = trainer_format(fmt)
    start = time.monotonic()
    try:
        store = Store.open(url, storage_options=storage_options)
    except (FileNotFoundError, zarr.errors.GroupNotFoundError) as exc:
        raise StoreAccessError(f"{url}: no store there ({exc})") from None
    if not store.planned and follow:
        _wait_for_the_plan(url, store, poll_s, say)
    if not store.planned:  # the dataset and the file names follow the whole plan
        raise ExportError(
            f"{url} is still being planned ({store.num_samples} samples so far): export it "
            "once its plan is complete"
        )
    refuse_images(url, store, fmt)
    last_slot = kind.check_store(url, store.manifest, allow_post_norm)
    sample_ids = [str(s) for s in np.asarray(store.group["sample_id"][:])]
    _check_unique(sample_ids)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    trainer = kind(out, store.manifest, last_slot)
    with exclusive(out):
        removed = remove_temporaries(out)
        if removed:
            say(f"export: removed {removed} temporary file(s) left by an interrupted run")
        doc = begin(url, store, trainer, sample_ids)
        for note in doc["notes"]:
            say(f"export: note: {note}")
        trainer.prepare(store, say)
        reader = HiddenStatesIterable(
            url,
            rank=0,
            world_size=1,
            storage_options=storage_options,
            fp8=trainer.fp8,
            follow=follow,
            poll_s=poll_s,
            max_poll_s=max(poll_s, 10.0),
            idle_timeout_s=idle_timeout_s,
        )
        check_same_store(url, doc["store_id"], reader.store_id)  # made again since it opened
        visible = reader.sample_indices
        exported = skipped = written = 0
        made: set[Path] = set()  # directories written into, fsynced at the end
        if not follow and all(trainer.sample_path(out, int(i)).exists() for i in visible):
            skipped = len(visible)  # nothing to write: do not read the store at all
        else:
            more = ", and those to come" if follow else ""
            say(f"export: {len(reader)} committed samples of {url}{more} -> {out} ({fmt})")
            index_of = {sid: i for i, sid in enumerate(sample_ids)}
            last = time.monotonic()
            for sample in reader:
                index = index_of[sample["sample_id"]]
                path = trainer.sample_path(out, index)
                if path.exists():
                    skipped += 1
                else:
                    if path.parent not in made:
                        path.parent.mkdir(parents=True, exist_ok=True)
                        made.add(path.parent)
                    written += write_atomic(path, trainer.encoder(sample))
                    exported += 1
                if time.monotonic() - last >= PROGRESS_EVERY_S:
                    last = time.monotonic()
                    say(
                        f"export: {exported + skipped}/{len(reader)} samples "
                        f"({exported} written, {skipped} already there), "
                        f"{written / 1e9:.2f} GB"
                    )
        visible = reader.sample_indices  # following: what committed meanwhile too
        pairs = [
            [int(i), sample_ids[i]] for i in visible if trainer.sample_path(out, int(i)).exists()
        ]
        write_doc(out, {**doc, "exported": pairs})
        for path in [*made, out]:  # the renames themselves, durable
            fsync_dir(path)
    summary = {
        "format": fmt,
        "out_dir": str(out),
        "exported": exported,
        "skipped": skipped,
        "files": len(pairs),
        "bytes": written,
        "seconds": round(time.monotonic() - start, 3),
        "removed_temporaries": removed,
        "ended": reader.ended,
    }
    say(
        f"export: {exported} samples written, {skipped} already there; {out} now holds "
        f"{len(pairs)} sample files ({written / 1e9:.3f} GB written in {summary['seconds']} s)"
        + (f"; following ended: {reader.ended}" if follow else "")
    )
    return summary


def refuse_images(url: str, store: Store, fmt: str) -> None:
    """A store holding images is not exported: neither trainer's offline format carries
    pixels (SpecForge removed its VLM training, commit 7d1fbf08; speculators' datasets hold
    the image placeholders only), so a drafter would train on image rows whose states came
    from images it never sees. A text plan on a vision model (no image in its table; its
    M-RoPE positions three equal aranges, the plain ones) exports as any text store."""
    if store.holds_images:
        images = store.array("image_sample").shape[0]
        raise ExportError(
            f"{url} is a store of images ({images} in its samples): the {fmt} format has no "
            "place for images (SpecForge's offline data and speculators' datasets carry no "
            "pixels), so it is not exported; train on it with the readers "
            "(hsx_store.reader), which yield each sample's images and positions"
        )


def _wait_for_the_plan(url: str, store: Store, poll_s: float, say: Callable[[str], Any]) -> None:
    """Wait, polling, until the store's plan is complete (the file names and speculators'
    dataset follow the whole plan). StoreReplaced if another store is made at `url` meanwhile
    (each refresh reads the group's attributes afresh)."""
    say(f"export: {url} is still being planned ({store.num_samples} samples so far): waiting")
    bound = store.group.attrs.get("store_id")
    while not store.planned:
        time.sleep(poll_s)
        try:
            store.refresh()
        except Exception as exc:  # another store's plan misread: say that, if so
            bound_attributes(url, store.group.store, bound, exc)
            raise
        check_same_store(url, bound, store.group.attrs.get("store_id"))  # read afresh by refresh


def _check_unique(sample_ids: list[str]) -> None:
    """Samples are exported under their store index, found by id: a store whose ids repeat
    (planned before ids holding NUL were refused) would map one sample's rows to another."""
    first: dict[str, int] = {}
    for i, sid in enumerate(sample_ids):
        if sid in first:
            raise ExportError(
                f"sample id {sid!r} is stored for samples {first[sid]} and {i}: this store "
                "cannot be exported sample by sample (plan it again)"
            )
        first[sid] = i


def read_exported(out_dir: str | Path, fmt: str, sample_index: int) -> dict[str, Any]:
    """One exported sample read back, in the reader's sample layout: sample_id, input_ids int64
    [T], loss_mask int64 [T], aux_hidden_states [T, num_aux * H] and the final state [T, H]
    under the reader's name for it: `final_hidden_states` (post-norm; SpecForge, or speculators
    with `last_slot` "post_norm") or `prenorm_hidden_states` (speculators). How each format's
    files are read: its read_sample."""
    out = Path(out_dir)
    ids, last_slot = exported_ids(out, fmt)
    if sample_index not in ids:
        raise KeyError(f"sample {sample_index} is not among the samples exported to {out}")
    sample = trainer_format(fmt).read_sample(out, sample_index, last_slot)
    return {"sample_id": ids[sample_index], **sample}
