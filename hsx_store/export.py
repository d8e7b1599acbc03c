"""Export a store to the offline formats of the released drafter trainers, SpecForge 0.2.0 and
vLLM speculators 0.9.0: `python -m cluster export --store URL --format {specforge,speculators}
--out DIR`.

Both stream committed, written samples through `HiddenStatesIterable` and name files by the
store's global sample index. Every file is written under a temporary name
(`.<name>.tmp-<pid>-<hex>`), fsynced and `os.replace`d, so an interrupted export leaves whole
files and resumes. `export.json` records the store (`store_id`), manifest, format and what was
written; a directory made from anything else is refused (`ExportConflict`). SpecForge: one
torch dict per sample, bf16, exactly 3 aux layers. speculators: a HF dataset, `token_freq.pt`
and a safetensors file per sample whose last slot is the pre-norm state (a store without it is
refused unless `allow_post_norm`); an FP8 store in its FP8 format.

Layouts, training commands, and the trainers' sources they were read from:
docs/using-the-data.md.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import functools
import json
import os
import secrets
import shutil
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import IO, Any, Literal

import numpy as np
import torch
import zarr

from hsx_store.format import FINAL_STATE_ARRAYS, Manifest, Store, StoreFormatError
from hsx_store.fp8 import FP8_DTYPE, scale_name
from hsx_store.layers import model_config, requested_layer_ids
from hsx_store.location import StoreAccessError
from hsx_store.reader import COMPLETE, HiddenStatesIterable, bound_attributes, check_same_store

Format = Literal["specforge", "speculators"]
FORMATS: tuple[str, ...] = ("specforge", "speculators")
EXPORT_JSON = "export.json"
# 2: store_id, hidden_dtype, last_slot; SpecForge always bf16, speculators' last slot pre-norm,
# token_freq.pt.
EXPORT_VERSION = 2
SPECFORGE_GROUP = 2000  # files per rows_* directory, as SpecForge's own generator groups them
SPECFORGE_NUM_AUX = 3  # SpecForge 0.2.0's EAGLE-3 draft: fc over 3 x hidden_size
SPECULATORS_SEQ_LEN = 8192  # speculators 0.9.0's --total-seq-len default
TOKEN_FREQ = "token_freq.pt"
ALLOW_POST_NORM_FLAG = "--allow-post-norm"
LOCK_NAME = ".export.lock"
TMP_MARK = ".tmp-"  # temporaries are ".<final name>.tmp-<pid>-<hex>"
PROGRESS_EVERY_S = 30.0


class ExportError(RuntimeError):
    """An export that cannot proceed (a concurrent export, a directory of unknown origin)."""


class ExportConflict(ExportError):
    """The output directory holds an export of another store, manifest or format."""


def sample_path(out_dir: str | Path, fmt: str, index: int) -> Path:
    """Where sample `index` (the store's global sample index) of a `fmt` export lives."""
    out = Path(out_dir)
    if fmt == "specforge":
        group = index // SPECFORGE_GROUP * SPECFORGE_GROUP
        return out / f"rows_{group}-{group + SPECFORGE_GROUP}" / f"data_{index}.ckpt"
    if fmt == "speculators":
        return out / "hidden_states" / f"hs_{index}.safetensors"
    raise ValueError(f"format must be one of {', '.join(FORMATS)}, got {fmt!r}")


def export(
    url: str,
    out_dir: str | Path,
    fmt: Format,
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
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {', '.join(FORMATS)}, got {fmt!r}")
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
    last_slot = _check_exportable(url, store.manifest, fmt, allow_post_norm)
    sample_ids = [str(s) for s in np.asarray(store.group["sample_id"][:])]
    _check_unique(sample_ids)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with _exclusive(out):
        removed = _remove_temporaries(out)
        if removed:
            say(f"export: removed {removed} temporary file(s) left by an interrupted run")
        doc = _begin(out, url, store, fmt, sample_ids, last_slot)
        for note in doc["notes"]:
            say(f"export: note: {note}")
        if fmt == "speculators":
            _write_dataset(out, store, say)  # with token_freq.pt
        # speculators has an FP8 format: its bits and scales go as they are; SpecForge: bf16.
        fp8 = "raw" if fmt == "speculators" else "dequantize"
        reader = HiddenStatesIterable(
            url,
            rank=0,
            world_size=1,
            storage_options=storage_options,
            fp8=fp8,
            follow=follow,
            poll_s=poll_s,
            max_poll_s=max(poll_s, 10.0),
            idle_timeout_s=idle_timeout_s,
        )
        check_same_store(url, doc["store_id"], reader.store_id)  # made again since it opened
        visible = reader.sample_indices
        exported = skipped = written = 0
        made: set[Path] = set()  # directories written into, fsynced at the end
        if not follow and all(sample_path(out, fmt, int(i)).exists() for i in visible):
            skipped = len(visible)  # nothing to write: do not read the store at all
        else:
            more = ", and those to come" if follow else ""
            say(f"export: {len(reader)} committed samples of {url}{more} -> {out} ({fmt})")
            index_of = {sid: i for i, sid in enumerate(sample_ids)}
            last = time.monotonic()
            for sample in reader:
                index = index_of[sample["sample_id"]]
                path = sample_path(out, fmt, index)
                if path.exists():
                    skipped += 1
                else:
                    if path.parent not in made:
                        path.parent.mkdir(parents=True, exist_ok=True)
                        made.add(path.parent)
                    written += _write_atomic(path, _encoder(fmt, sample, store, last_slot))
                    exported += 1
                if time.monotonic() - last >= PROGRESS_EVERY_S:
                    last = time.monotonic()
                    say(
                        f"export: {exported + skipped}/{len(reader)} samples "
                        f"({exported} written, {skipped} already there), "
                        f"{written / 1e9:.2f} GB"
                    )
        visible = reader.sample_indices  # following: what committed meanwhile too
        pairs = [[int(i), sample_ids[i]] for i in visible if sample_path(out, fmt, int(i)).exists()]
        _write_doc(out, {**doc, "exported": pairs})
        for path in [*made, out]:  # the renames themselves, durable
            _fsync_dir(path)
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


def read_exported(out_dir: str | Path, fmt: Format, sample_index: int) -> dict[str, Any]:
    """One exported sample read back, in the reader's sample layout: sample_id, input_ids int64
    [T], loss_mask int64 [T], aux_hidden_states [T, num_aux * H] and the final state [T, H]
    under the reader's name for it: `final_hidden_states` (post-norm; SpecForge, or speculators
    with `last_slot` "post_norm") or `prenorm_hidden_states` (speculators). SpecForge files are
    read with `torch.load(weights_only=True)`; speculators files with safetensors, their
    loss_mask from the export's dataset row (that format keeps it there)."""
    out = Path(out_dir)
    ids, last_slot = _exported_ids(out / EXPORT_JSON, fmt)
    if sample_index not in ids:
        raise KeyError(f"sample {sample_index} is not among the samples exported to {out}")
    path = sample_path(out, fmt, sample_index)
    if fmt == "specforge":
        data = torch.load(path, map_location="cpu", weights_only=True)
        return {
            "sample_id": ids[sample_index],
            "input_ids": data["input_ids"],
            "loss_mask": data["loss_mask"],
            "aux_hidden_states": data["aux_hidden_state"].squeeze(0),
            "final_hidden_states": data["hidden_state"].squeeze(0),
        }
    from safetensors.torch import load_file

    data = load_file(path)
    hidden = data["hidden_states"]
    if "hidden_states_scales" in data:  # the FP8 format, as speculators' FP8Transfer reads it
        hidden = hidden.to(torch.bfloat16) * data["hidden_states_scales"].to(torch.bfloat16)
    row = _load_dataset(out)[sample_index]
    return {
        "sample_id": ids[sample_index],
        "input_ids": data["token_ids"],
        "loss_mask": row["loss_mask"],
        "aux_hidden_states": hidden[:, :-1].reshape(len(hidden), -1),
        FINAL_STATE_ARRAYS[last_slot]: hidden[:, -1],
    }


def main(argv: list[str] | None = None) -> int:
    """`python -m cluster export --store URL --format {specforge,speculators} --out DIR`:
    exit 0 once every committed sample is exported, 2 when the store cannot be opened, 1 on any
    other error (printed). With --follow: exit 0 once the job is complete and every sample
    exported, 1 when following ended short of that (said)."""
    parser = argparse.ArgumentParser(
        prog="python -m cluster export",
        description="Export a store's committed samples to SpecForge or vLLM speculators "
        "offline training files (resumable; see hsx_store/export.py).",
    )
    parser.add_argument("--store", required=True, metavar="URL", help="the store (store.url)")
    parser.add_argument("--format", required=True, choices=FORMATS, help="target format")
    parser.add_argument("--out", required=True, metavar="DIR", help="output directory")
    parser.add_argument(
        ALLOW_POST_NORM_FLAG,
        action="store_true",
        help="speculators, a store without the pre-norm final state: write the post-norm one "
        "in the last slot (speculators normalizes it again: a wrong teacher)",
    )
    parser.add_argument(
        "--follow",
        action="store_true",
        help="a running job: export its shards as they commit, until it ends "
        "(exit 1 unless it ended complete)",
    )
    parser.add_argument("--poll-s", type=float, default=2.0, help="with --follow")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        summary = export(
            args.store,
            args.out,
            args.format,
            allow_post_norm=args.allow_post_norm,
            say=lambda text: print(text, flush=True),
            follow=args.follow,
            poll_s=args.poll_s,
        )
    except (StoreFormatError, StoreAccessError) as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
    except (ExportError, OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 1
    return 1 if args.follow and summary["ended"] != COMPLETE else 0


# ---- what each format writes -------------------------------------------------------------


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


def _check_exportable(url: str, m: Manifest, fmt: str, allow_post_norm: bool) -> str | None:
    """Refuses what the trainer cannot train on correctly, before anything is written.
    Returns the final state speculators' last slot gets ("pre_norm" / "post_norm")."""
    if fmt == "specforge":
        if m.num_aux != SPECFORGE_NUM_AUX:
            raise ExportError(
                f"{url}: {m.num_aux} aux layers (layer_ids {m.layer_ids}); SpecForge 0.2.0 "
                f"trains EAGLE-3 on exactly {SPECFORGE_NUM_AUX} (its draft's fc takes "
                f"{SPECFORGE_NUM_AUX} x hidden_size and model.aux_hidden_state_layer_ids must "
                f"hold three ids): export this store with --format speculators"
            )
        return None
    if "pre_norm" in m.final_states:
        return "pre_norm"
    if not allow_post_norm:
        raise ExportError(
            f"{url}: the store holds no pre-norm final state (final states "
            f"{m.final_states}); speculators builds its teacher as lm_head(norm(last slot)), "
            f"so the post-norm state would be normalized twice. Capture again with "
            f"store.prenorm: true, or pass {ALLOW_POST_NORM_FLAG} to export the post-norm "
            f"state anyway"
        )
    return "post_norm"


def _encoder(
    fmt: str, sample: dict[str, Any], store: Store, last_slot: str | None
) -> Callable[[IO[bytes]], None]:
    """The writer of one sample's file. The reader's tensors may view a whole read block:
    they are copied so a file holds its own sample only (bit for bit, but for SpecForge's
    float32 -> bf16 cast)."""
    ids = sample["input_ids"].clone()
    if fmt == "specforge":
        data = {  # SpecForge's DataPoint, in its field order
            "input_ids": ids,
            "loss_mask": sample["loss_mask"].clone(),
            "hidden_state": _bf16(sample["final_hidden_states"]).unsqueeze(0),
            "aux_hidden_state": _bf16(sample["aux_hidden_states"]).unsqueeze(0),
        }
        return functools.partial(torch.save, data)
    from safetensors.torch import save

    m = store.manifest
    aux = sample["aux_hidden_states"].reshape(len(ids), m.num_aux, m.hidden_size)
    final = sample[FINAL_STATE_ARRAYS[last_slot]].reshape(len(ids), 1, m.hidden_size)
    tensors = {"hidden_states": torch.cat([aux, final], dim=1), "token_ids": ids}
    if m.dtype == FP8_DTYPE:  # the reader's raw values: their scales go alongside
        names = ("aux_hidden_states", FINAL_STATE_ARRAYS[last_slot])  # the slots above
        scales = [sample[scale_name(n)].reshape(len(ids), -1) for n in names]
        tensors["hidden_states_scales"] = torch.cat(scales, dim=1).unsqueeze(-1)
    blob = save(tensors)
    return lambda f: f.write(blob)


def _bf16(t: torch.Tensor) -> torch.Tensor:
    """A bf16 copy: bf16 bit for bit, float32 rounded to nearest even (torch's cast)."""
    return t.clone() if t.dtype == torch.bfloat16 else t.to(torch.bfloat16)


def _write_dataset(out: Path, store: Store, say: Callable[[str], Any]) -> None:
    """The speculators dataset: one row per planned sample (row = global sample index), from
    the plan's own rows, a shard at a time, and token_freq.pt counted from the same rows.
    state.json is moved in last: its presence marks a complete dataset (and token_freq.pt)."""
    if (out / "state.json").exists():
        return
    import datasets
    import pyarrow as pa

    say(f"export: writing the {store.num_samples}-row dataset speculators reads (input_ids, ...)")
    tmp = _tmp_name(out / "dataset")
    tmp.mkdir()
    was_enabled = datasets.is_progress_bar_enabled()
    try:
        schema = pa.schema(
            [
                ("input_ids", pa.list_(pa.int64())),
                ("loss_mask", pa.list_(pa.int64())),
                ("seq_len", pa.int64()),
            ]
        )
        rows = tmp / "rows.arrow"
        freq: Counter[int] = Counter()
        with pa.OSFile(str(rows), "wb") as f, pa.ipc.new_stream(f, schema) as writer:
            for sh in store.shards:  # samples lie back to back from token_begin
                lengths = store.sample_length[sh.sample_begin : sh.sample_end].astype(np.int64)
                offsets = pa.array(np.concatenate([[0], np.cumsum(lengths)]), pa.int32())
                span = slice(sh.token_begin, sh.token_end)
                ids, mask = (np.asarray(store.group[n][span], np.int64) for n in TOKEN_COLUMNS)
                columns = [pa.ListArray.from_arrays(offsets, pa.array(a)) for a in (ids, mask)]
                writer.write_batch(pa.record_batch([*columns, pa.array(lengths)], schema=schema))
                freq.update(_token_counts(ids, mask))
        # speculators' save_token_frequency_distribution: {token id: count} over loss_mask 1.
        _write_atomic(out / TOKEN_FREQ, functools.partial(torch.save, dict(freq)))
        datasets.disable_progress_bars()
        dataset = datasets.Dataset.from_file(str(rows)).with_format("torch")
        dataset.save_to_disk(str(tmp / "saved"))
        del dataset
        names = sorted(os.listdir(tmp / "saved"))
        for name in [n for n in names if n != "state.json"] + ["state.json"]:
            with open(tmp / "saved" / name, "rb") as f:
                os.fsync(f.fileno())
            os.replace(tmp / "saved" / name, out / name)
    finally:
        if was_enabled:
            datasets.enable_progress_bars()
        shutil.rmtree(tmp, ignore_errors=True)


TOKEN_COLUMNS = ("input_ids", "loss_mask")


def _token_counts(ids: np.ndarray, mask: np.ndarray) -> dict[int, int]:
    """Occurrences of each loss-masked token (the rows between samples are zero: unmasked)."""
    tokens, counts = np.unique(ids[mask.astype(bool)], return_counts=True)
    return dict(zip(tokens.tolist(), counts.tolist(), strict=True))


@functools.lru_cache(maxsize=4)
def _cached_dataset(path: str, mtime_ns: int) -> Any:
    import datasets

    return datasets.load_from_disk(path)


def _load_dataset(out: Path) -> Any:
    return _cached_dataset(str(out), (out / "state.json").stat().st_mtime_ns)


# ---- export.json: identity, conflicts, mapping --------------------------------------------


def _identity(url: str, store: Store, fmt: str, last_slot: str | None) -> dict[str, Any]:
    """What must be equal for a resumed export to add to a directory's files."""
    return json.loads(  # through JSON, as it is compared with a stored copy
        json.dumps(
            {
                "format": fmt,
                "store_url": _normal_url(url),
                # None for a store created before store ids: its URL, manifest and job only.
                "store_id": store.group.attrs.get("store_id"),
                "manifest": store.manifest.to_json(),
                "job": store.job,
                "hidden_dtype": "bfloat16" if fmt == "specforge" else store.manifest.dtype,
                "last_slot": last_slot,
            }
        )
    )


def _specforge_layers(manifest: Manifest) -> list[int] | None:
    """SpecForge's model.aux_hidden_state_layer_ids for the store's layers: the ids SGLang is
    asked for (Llama-style models add 1 to each, DeepSeek-style take them as given), computed
    from the model's config.json when it is readable here."""
    try:
        return requested_layer_ids(model_config(Path(manifest.model)), manifest.layer_ids)
    except (OSError, ValueError, KeyError):
        return None


def specforge_run_config(out: Path, manifest: Manifest) -> dict[str, Any]:
    """The minimal run.yaml of `specforge train -c run.yaml` (SpecForge 0.2.0's
    config/schema.py) for this export: offline mode through `data.hidden_states_path`."""
    model: dict[str, Any] = {"target_model_path": manifest.model}
    layers = _specforge_layers(manifest)
    if layers is not None:
        model["aux_hidden_state_layer_ids"] = layers
    return {
        "model": model,
        # max_length: SpecForge truncates every sample to it (default 2048).
        "data": {"hidden_states_path": str(out.resolve()), "max_length": manifest.max_length},
    }


def speculators_command(out: Path, manifest: Manifest) -> str:
    """`speculators train` (0.9.0) on this export: the aux layer ids only (the last slot is
    not one), rows without a file skipped rather than generated by a vLLM server."""
    words = [
        "speculators train",
        f"--verifier-name-or-path {manifest.model}",
        f"--data-path {out.resolve()}",
        "--on-missing skip",
        *(["--hidden-states-backend fp8"] if manifest.dtype == FP8_DTYPE else []),
        f"--target-layer-ids {' '.join(map(str, manifest.layer_ids))}",
    ]
    if manifest.max_length > SPECULATORS_SEQ_LEN:  # it truncates packed batches to this
        words.append(f"--total-seq-len {manifest.max_length}")
    return " ".join(words)


def _notes(out: Path, store: Store, fmt: str, last_slot: str | None) -> list[str]:
    m = store.manifest
    if fmt == "specforge":
        config = specforge_run_config(out, m)
        notes = [
            "train with `specforge train -c run.yaml` (SpecForge 0.2.0), run.yaml holding "
            + json.dumps(config)
            + " (export.json: specforge_run_config)"
        ]
        if "aux_hidden_state_layer_ids" not in config["model"]:
            notes.append(
                f"add model.aux_hidden_state_layer_ids: the ids SGLang is asked for, HF "
                f"indices {m.layer_ids} minus 1 for Llama-style models, as given for "
                f"DeepSeek-style ones ({m.model}/config.json is not readable here)"
            )
        if m.dtype == "float32":  # an FP8 store's reader dequantizes to bf16 exactly
            notes.append(
                f"hidden states cast from {m.dtype} to bfloat16 (round to nearest even): "
                f"SpecForge's target head is bf16"
            )
        return notes
    notes = [
        f"train with `{speculators_command(out, m)}` (speculators 0.9.0; add "
        f"--draft-vocab-size N to prune the draft vocabulary with {TOKEN_FREQ}; rows without "
        f"a file are failed or uncommitted samples)"
    ]
    if last_slot != "pre_norm":
        notes.append(
            f"{ALLOW_POST_NORM_FLAG}: hidden_states[:, -1] holds the post-norm final state; "
            f"speculators applies the verifier's final norm to it again before the lm_head, "
            f"so its teacher is wrong"
        )
    return notes


def _begin(
    out: Path, url: str, store: Store, fmt: str, sample_ids: list[str], last_slot: str | None
) -> dict:
    """export.json at the start of a run: created for a fresh directory, checked (and kept) for
    a resumed one. Refuses another store's, manifest's or format's directory."""
    identity = _identity(url, store, fmt, last_slot)
    m = store.manifest
    doc = {
        "export_version": EXPORT_VERSION,
        **identity,
        "final_states": m.final_states,
        "layer_ids": list(m.layer_ids),
        "layout": _layout(fmt, m),
        "notes": _notes(out, store, fmt, last_slot),
        "num_planned_samples": int(store.num_samples),
    }
    if fmt == "specforge":
        doc["specforge_aux_layers"] = _specforge_layers(m)
        doc["specforge_run_config"] = specforge_run_config(out, m)
    else:
        doc["speculators_command"] = speculators_command(out, m)
    path = out / EXPORT_JSON
    if not path.exists():
        strays = [p.name for p in out.iterdir() if p.name != LOCK_NAME and TMP_MARK not in p.name]
        if strays:
            raise ExportError(
                f"{out} is not empty ({', '.join(sorted(strays)[:5])}) and has no {EXPORT_JSON}: "
                f"not an export made here; refusing to write into it"
            )
        _write_doc(out, {**doc, "exported": []})
        return doc
    try:
        old = read_doc(path)
    except ExportError as exc:
        raise ExportConflict(f"{exc}; refusing to write into {out}") from None
    differ = _differences(old, identity)
    for index, sid in old.get("exported", []):
        if not (0 <= index < len(sample_ids)) or sample_ids[index] != sid:
            differ.append(f"sample {index} is {sid!r} there, not in this store")
            break
    if differ:
        raise ExportConflict(
            f"{out} holds an export of another store or format: {'; '.join(differ)}. "
            f"Export into another directory."
        )
    if old.get("num_planned_samples") != doc["num_planned_samples"]:
        # Exported before the plan was complete (allowed once): its dataset and token counts
        # cover the samples planned then, and are made again for the whole plan.
        (out / "state.json").unlink(missing_ok=True)
    return doc


def _differences(old: dict, new: dict) -> list[str]:
    out = []
    if old.get("export_version") != EXPORT_VERSION:
        out.append(
            f"export_version {old.get('export_version')!r} (this code writes {EXPORT_VERSION})"
        )
    for key in ("format", "store_url", "store_id", "job", "hidden_dtype", "last_slot"):
        if old.get(key) != new[key]:
            out.append(f"{key} {old.get(key)!r} there, {new[key]!r} here")
    old_m, new_m = old.get("manifest") or {}, new["manifest"]
    fields = sorted(k for k in set(old_m) | set(new_m) if old_m.get(k) != new_m.get(k))
    if fields:
        out.append(f"manifest differs in {', '.join(fields)}")
    return out


def _layout(fmt: str, m: Manifest) -> dict[str, str]:
    if fmt == "specforge":
        return {
            "files": f"rows_{{g}}-{{g+{SPECFORGE_GROUP}}}/data_{{index}}.ckpt",
            "index": "the store's global sample index",
            "keys": "input_ids int64 [T], loss_mask int64 [T], hidden_state bf16 [1,T,H] "
            "(post-norm), aux_hidden_state bf16 [1,T,3*H]",
        }
    keys = "hidden_states [T,num_aux+1,H] (aux layers, then the final state of last_slot), "
    keys += "token_ids int64 [T]"
    if m.dtype == FP8_DTYPE:
        keys += ", hidden_states_scales float32 [T,num_aux+1,1] (hidden_states float8_e4m3fn)"
    return {
        "files": "hidden_states/hs_{index}.safetensors",
        "index": "the store's global sample index = the row of the dataset in this directory",
        "keys": keys,
        "dataset": "datasets.load_from_disk(DIR): input_ids, loss_mask, seq_len per planned sample",
        "token_freq": f"{TOKEN_FREQ}: {{token id: count}} over loss-masked tokens of every row",
    }


def read_doc(path: Path) -> dict:
    """export.json, checked for what is read of it: a mapping whose `exported` is a list of
    [sample index, sample id] pairs. ExportError names the file and what is wrong."""
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ExportError(f"{path}: unreadable ({exc})") from None
    if not isinstance(doc, dict):
        raise ExportError(f"{path}: not an export's record (a {type(doc).__name__}, not a mapping)")
    exported = doc.get("exported")
    listed = isinstance(exported, list)
    strays = [p for p in exported if not _is_pair(p)][:1] if listed else [exported]
    if strays:
        raise ExportError(
            f"{path}: `exported` must list [sample index, sample id] pairs, found {strays[0]!r:.80}"
        )
    return doc


def _is_pair(item: Any) -> bool:
    return (
        isinstance(item, list) and len(item) == 2 and type(item[0]) is int and type(item[1]) is str
    )


@functools.lru_cache(maxsize=4)
def _cached_ids(path: str, mtime_ns: int, fmt: str) -> tuple[dict[int, str], str | None]:
    doc = read_doc(Path(path))
    if doc.get("format") != fmt:
        raise ExportError(f"{path}: a {doc.get('format')!r} export, not {fmt!r}")
    return {int(i): str(sid) for i, sid in doc["exported"]}, doc.get("last_slot")


def _exported_ids(path: Path, fmt: str) -> tuple[dict[int, str], str | None]:
    return _cached_ids(str(path), path.stat().st_mtime_ns, fmt)


def _write_doc(out: Path, doc: dict) -> None:
    """Readable header, then `exported` as one compact line (it can hold millions of pairs)."""
    head = json.dumps({k: v for k, v in doc.items() if k != "exported"}, indent=1)
    pairs = json.dumps(doc["exported"], separators=(",", ":"), ensure_ascii=False)
    blob = f'{head[:-2]},\n "exported": {pairs}\n}}\n'.encode()
    _write_atomic(out / EXPORT_JSON, lambda f: f.write(blob))


# ---- files ---------------------------------------------------------------------------------


def _tmp_name(path: Path) -> Path:
    return path.parent / f".{path.name}{TMP_MARK}{os.getpid()}-{secrets.token_hex(4)}"


def _write_atomic(path: Path, write: Callable[[IO[bytes]], Any]) -> int:
    """Write under a temporary name in the same directory, fsync, rename: the final name only
    ever holds a whole file. Returns the bytes written."""
    tmp = _tmp_name(path)
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
            size = f.tell()
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return size


def _remove_temporaries(out: Path) -> int:
    """Temporaries of interrupted runs (this run holds the lock: none is anyone's live file)."""
    removed = 0
    for root, dirs, files in os.walk(out):
        for name in [d for d in dirs if d.startswith(".") and TMP_MARK in d]:
            shutil.rmtree(Path(root) / name, ignore_errors=True)
            dirs.remove(name)
            removed += 1
        for name in files:
            if name.startswith(".") and TMP_MARK in name:
                (Path(root) / name).unlink(missing_ok=True)
                removed += 1
    return removed


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def _exclusive(out: Path) -> Iterator[None]:
    """One export at a time per directory (a second one would delete the first's temporaries)."""
    with open(out / LOCK_NAME, "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ExportError(f"another export is writing into {out}") from None
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


# ---- the store -----------------------------------------------------------------------------


def _normal_url(url: str) -> str:
    return url if "://" in url else os.path.abspath(url)


if __name__ == "__main__":
    sys.exit(main())
