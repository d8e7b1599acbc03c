"""Exporters from a store to the two offline formats drafter trainers read: SpecForge and vLLM
speculators (`python -m cluster export --store URL --format {specforge,speculators} --out DIR`).

Both stream the store through `HiddenStatesIterable` (one block of samples in memory at a time),
so only committed, written samples are exported; uncommitted shards and failed samples never are.
Files are named by the store's *global* sample index (its row in the plan), stable across
resumes and across shards committed later. Every file is written under a temporary name in its
own directory (`.<name>.tmp-<pid>-<hex>`, which neither trainer's file scan matches), fsynced,
then `os.replace`d: an interrupted export leaves whole files only, and the next run removes the
temporaries and skips every sample whose file exists. `export.json` in the output directory
records the store URL, its manifest and `job`, the format, and `exported` ([index, sample_id]
pairs), written before the first sample (so a resumed run can check it) and rewritten at the end;
a run against another store, manifest or format into the same directory is refused
(`ExportConflict`), as is a non-empty directory without `export.json`. Hidden states are copied
bit for bit (bf16 stays bf16, float32 stays float32): neither format demands a conversion.

SpecForge (sgl-project/SpecForge), offline EAGLE-3 training data, one torch-saved dict per sample:

    OUT/rows_{g}-{g + 2000}/data_{index}.ckpt      g = index // 2000 * 2000
    {"input_ids":        int64 [T],
     "loss_mask":        int64 [T],
     "hidden_state":     [1, T, H]            final hidden state, post-norm (the lm_head input)
     "aux_hidden_state": [1, T, num_aux * H]} aux layers concatenated on the last axis
hidden states in the model dtype (bf16 here), with the batch axis of 1 the generator adds.
Sources: `scripts/prepare_hidden_states.py` (commit f1424fb6): the `DataPoint` dataclass saved
with `torch.save(asdict(...))` in that key order, `_get_file_path` (`rows_{g}-{g+size}/
data_{idx}.ckpt`, `--file-group-size` default 2000), `last_hidden_states` / `aux_hidden_states`
saved as `.cpu().clone().unsqueeze(0)`, input_ids / loss_mask 1-D. `specforge/data/
preprocessing.py` (commit 280fab91): `list_local_files` walks the directory for `*.ckpt` (later
versions also `.ckpt.gz`, sorted), `OfflineEagle3Dataset.process_data` feeds
`aux_hidden_state.squeeze(0)` to the draft model as "hidden_state" and `hidden_state.squeeze(0)`
as "target", after `torch.load(path, weights_only=False[, mmap=True])`. `specforge/modeling/
target/target_head.py` (commit afc8195a): `TargetHead.forward` is the bare lm_head (no norm), and
`sglang_backend/utils.py` (commit 5fbac9e8) takes `last_hidden_states` as the input of SGLang's
LogitsProcessor (after the model's final norm) and `torch.cat(aux_hidden_states, dim=-1)`: so
`hidden_state` is post-norm, as this store's `final_hidden_states` (manifest `final_state`).
Layer numbering: SpecForge's `--aux-hidden-states-layers` (default `[1, L // 2 - 1, L - 4]`,
`specforge/modeling/target/eagle3_target_model.py`, commit f093c4e6) are SGLang capture ids,
which SGLang's `set_eagle3_layers_to_capture` resolves per model family ("we will add 1 to the
layer index", `prepare_hidden_states.py` commit 0168a597, holds for Llama-style models;
DeepSeek-style ones take the ids as given unless the first is 1): export.json records the ids
that resolve to this store's HF indices as `specforge_aux_layers` (store.layers.
requested_layer_ids; null when the model's config.json is not readable where it runs).

vLLM speculators (vllm-project/speculators), `scripts/train.py --data-path OUT`, read by
`speculators.train.data.ArrowDataset`:

    OUT/  a Hugging Face dataset (`save_to_disk`: state.json, dataset_info.json, data-*.arrow)
          with one row per planned sample of the store, in store order, torch format:
          input_ids int64 [T], loss_mask int64 [T], seq_len int64
    OUT/hidden_states/hs_{index}.safetensors
          {"hidden_states": [T, num_aux + 1, H]   aux layers in ascending layer_ids, then final
           "token_ids":     int64 [T]}            equal to the row's input_ids
Sources: `src/speculators/train/data.py` (commit 0332621a): `ArrowDataset` loads
`load_from_disk(datapath)`, hidden states from `FileTransfer(datapath / "hidden_states")`
(`--hidden-states-path`), file index = dataset row index; it requires `token_ids` to equal the
row's `input_ids`, takes `hidden_states[:, :-1].flatten(1)` as the draft input and
`hidden_states[:, -1]` as `verifier_last_hidden_states`, `loss_mask` from the row and lengths
from `seq_len`. `src/speculators/_vendor/hs_connectors/transfer.py` (commit 1e3238f8):
`hs_{file_idx}.safetensors`, read with `safetensors.torch.load_file`. `src/speculators/
data_generation/offline.py` (commit f9c870a4): "hs_i.safetensors (where i is the file index)";
its later `check_hidden_states` (imported by data.py above) wants keys `token_ids` and
`hidden_states`, `hidden_states.shape[0] == len(tokens)` and finite values. `scripts/train.py`
(commit 02a40fe7): `--data-path`, `--hidden-states-path`, `--on-missing`, `--target-layer-ids`.
`scripts/launch_vllm.py` (commit 01a981e8): vLLM's `extract_hidden_states` method with target
layer ids `[2, L // 2, L - 3, L]` by default (`--include-last-layer` appends L =
num_hidden_layers), the ids counting like HF `hidden_states` indices; vLLM's
`ExampleHiddenStatesConnector` writes exactly these two keys, bf16. Rows without a file (failed
or uncommitted samples) make the trainer fall back to `--on-missing` (default "generate", which
asks a vLLM server): train with `--on-missing skip`, and with `--target-layer-ids <layer_ids> L`
unless the layer ids are the default.

Mismatch (speculators only): vLLM's slot L is the last decoder layer's output *before* the model's
final norm, and the trainer applies the verifier's final norm (`model.norm.weight`) to
`hidden_states[:, -1]` before its lm_head (vllm-project/speculators PR #313, merged 2026-02-26,
`src/speculators/models/eagle3/core.py`; earlier releases applied no norm). This store keeps the
*post-norm* final state, so such a trainer normalizes twice; RMSNorm drops the scale, so the
pre-norm state cannot be rebuilt here. The export writes the stored bits unchanged, warns, and
records `final_state` in export.json. SpecForge expects post-norm and has no such mismatch.
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
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import IO, Any, Literal

import numpy as np
import torch
import zarr

from store.format import Manifest, Store, StoreFormatError
from store.layers import model_config, requested_layer_ids
from store.location import StoreAccessError
from store.reader import HiddenStatesIterable

Format = Literal["specforge", "speculators"]
FORMATS: tuple[str, ...] = ("specforge", "speculators")
EXPORT_JSON = "export.json"
EXPORT_VERSION = 1
SPECFORGE_GROUP = 2000  # SpecForge's --file-group-size default
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
    say: Callable[[str], Any] = print,
) -> dict[str, Any]:
    """Export every committed, written sample of the store at `url` into `out_dir` in `fmt`
    (see the module docstring for both layouts). Resumable: a sample whose file exists is
    skipped. Returns {format, out_dir, exported (written this run), skipped (already there),
    files (sample files the export now holds), bytes (written this run), seconds,
    removed_temporaries}."""
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    start = time.monotonic()
    try:
        store = Store.open(url, storage_options=storage_options)
    except (FileNotFoundError, zarr.errors.GroupNotFoundError) as exc:
        raise StoreAccessError(f"{url}: no store there ({exc})") from None
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    sample_ids = [str(s) for s in np.asarray(store.group["sample_id"][:])]
    with _exclusive(out):
        removed = _remove_temporaries(out)
        if removed:
            say(f"export: removed {removed} temporary file(s) left by an interrupted run")
        doc = _begin(out, url, store, fmt, sample_ids)
        for note in doc["notes"]:
            say(f"export: note: {note}")
        if fmt == "speculators":
            _write_dataset(out, store, say)
        reader = HiddenStatesIterable(url, rank=0, world_size=1, storage_options=storage_options)
        visible = reader.sample_indices
        exported = skipped = written = 0
        made: set[Path] = set()  # directories written into, fsynced at the end
        if all(sample_path(out, fmt, int(i)).exists() for i in visible):
            skipped = len(visible)  # nothing to write: do not read the store at all
        else:
            say(f"export: {len(reader)} committed samples of {url} -> {out} ({fmt})")
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
                    written += _write_atomic(path, _encoder(fmt, sample, store))
                    exported += 1
                if time.monotonic() - last >= PROGRESS_EVERY_S:
                    last = time.monotonic()
                    say(
                        f"export: {exported + skipped}/{len(reader)} samples "
                        f"({exported} written, {skipped} already there), "
                        f"{written / 1e9:.2f} GB"
                    )
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
    }
    say(
        f"export: {exported} samples written, {skipped} already there; {out} now holds "
        f"{len(pairs)} sample files ({written / 1e9:.3f} GB written in {summary['seconds']} s)"
    )
    return summary


def read_exported(out_dir: str | Path, fmt: Format, sample_index: int) -> dict[str, Any]:
    """One exported sample read back, in the reader's sample layout: sample_id, input_ids int64
    [T], loss_mask int64 [T], aux_hidden_states [T, num_aux * H], final_hidden_states [T, H].
    SpecForge files are read with `torch.load(weights_only=True)`; speculators files with
    safetensors, their loss_mask from the export's dataset row (that format keeps it there)."""
    out = Path(out_dir)
    ids = _exported_ids(out / EXPORT_JSON, fmt)
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
    row = _load_dataset(out)[sample_index]
    return {
        "sample_id": ids[sample_index],
        "input_ids": data["token_ids"],
        "loss_mask": row["loss_mask"],
        "aux_hidden_states": hidden[:, :-1].reshape(len(hidden), -1),
        "final_hidden_states": hidden[:, -1],
    }


def main(argv: list[str] | None = None) -> int:
    """`python -m cluster export --store URL --format {specforge,speculators} --out DIR`:
    exit 0 once every committed sample is exported, 2 when the store cannot be opened, 1 on any
    other error (printed)."""
    parser = argparse.ArgumentParser(
        prog="python -m cluster export",
        description="Export a store's committed samples to SpecForge or vLLM speculators "
        "offline training files (resumable; see store/export.py).",
    )
    parser.add_argument("--store", required=True, metavar="URL", help="the store (store.url)")
    parser.add_argument("--format", required=True, choices=FORMATS, help="target format")
    parser.add_argument("--out", required=True, metavar="DIR", help="output directory")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        export(args.store, args.out, args.format, say=lambda text: print(text, flush=True))
    except (StoreFormatError, StoreAccessError) as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
    except (ExportError, OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 1
    return 0


# ---- what each format writes -------------------------------------------------------------


def _encoder(fmt: str, sample: dict[str, Any], store: Store) -> Callable[[IO[bytes]], None]:
    """The writer of one sample's file. The reader's tensors may view a whole read block:
    they are copied (bit for bit) so a file holds its own sample only."""
    ids = sample["input_ids"].clone()
    if fmt == "specforge":
        data = {  # SpecForge's DataPoint, in its field order
            "input_ids": ids,
            "loss_mask": sample["loss_mask"].clone(),
            "hidden_state": sample["final_hidden_states"].clone().unsqueeze(0),
            "aux_hidden_state": sample["aux_hidden_states"].clone().unsqueeze(0),
        }
        return functools.partial(torch.save, data)
    from safetensors.torch import save

    m = store.manifest
    aux = sample["aux_hidden_states"].reshape(len(ids), m.num_aux, m.hidden_size)
    final = sample["final_hidden_states"].reshape(len(ids), 1, m.hidden_size)
    blob = save({"hidden_states": torch.cat([aux, final], dim=1), "token_ids": ids})
    return lambda f: f.write(blob)


def _write_dataset(out: Path, store: Store, say: Callable[[str], Any]) -> None:
    """The speculators dataset: one row per planned sample (row = global sample index), from
    the plan's own rows, a shard at a time. state.json is moved in last: its presence marks a
    complete dataset."""
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
        with pa.OSFile(str(rows), "wb") as f, pa.ipc.new_stream(f, schema) as writer:
            for sh in store.shards:  # samples lie back to back from token_begin
                lengths = store.sample_length[sh.sample_begin : sh.sample_end].astype(np.int64)
                offsets = pa.array(np.concatenate([[0], np.cumsum(lengths)]), pa.int32())
                span = slice(sh.token_begin, sh.token_end)
                columns = [
                    pa.ListArray.from_arrays(
                        offsets, pa.array(np.asarray(store.group[name][span], np.int64))
                    )
                    for name in ("input_ids", "loss_mask")
                ]
                writer.write_batch(pa.record_batch([*columns, pa.array(lengths)], schema=schema))
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


@functools.lru_cache(maxsize=4)
def _cached_dataset(path: str, mtime_ns: int) -> Any:
    import datasets

    return datasets.load_from_disk(path)


def _load_dataset(out: Path) -> Any:
    return _cached_dataset(str(out), (out / "state.json").stat().st_mtime_ns)


# ---- export.json: identity, conflicts, mapping --------------------------------------------


def _identity(url: str, store: Store, fmt: str) -> dict[str, Any]:
    return json.loads(  # through JSON, as it is compared with a stored copy
        json.dumps(
            {
                "format": fmt,
                "store_url": _normal_url(url),
                "manifest": store.manifest.to_json(),
                "job": store.job,
            }
        )
    )


def _specforge_layers(manifest: Manifest) -> list[int] | None:
    """SpecForge's --aux-hidden-states-layers for the store's layers: the ids SGLang is asked
    for (Llama-style models add 1 to each, DeepSeek-style take them as given), computed from
    the model's config.json when it is readable here."""
    try:
        return requested_layer_ids(model_config(Path(manifest.model)), manifest.layer_ids)
    except (OSError, ValueError, KeyError):
        return None


def _notes(store: Store, fmt: str) -> list[str]:
    m = store.manifest
    if fmt == "specforge":
        layers = _specforge_layers(m)
        if layers is None:
            return [
                f"SpecForge's --aux-hidden-states-layers are the ids SGLang is asked for: HF "
                f"indices {m.layer_ids} minus 1 for Llama-style models, as given for "
                f"DeepSeek-style ones ({m.model}/config.json is not readable here)"
            ]
        return [f"train SpecForge with --aux-hidden-states-layers {','.join(map(str, layers))}"]
    notes = [
        f"train with speculators' scripts/train.py --data-path DIR --on-missing skip "
        f"--target-layer-ids {' '.join(map(str, m.layer_ids))} <num_hidden_layers> "
        f"(rows without a file are failed or uncommitted samples)"
    ]
    notes.append(
        "hidden_states[:, -1] holds this store's post-norm final state; speculators "
        "(since vllm-project/speculators PR #313) applies the verifier's final norm to it "
        "before the lm_head, as vLLM captures it pre-norm: with this export the target is "
        "normalized twice"
    )
    return notes


def _begin(out: Path, url: str, store: Store, fmt: str, sample_ids: list[str]) -> dict:
    """export.json at the start of a run: created for a fresh directory, checked (and kept) for
    a resumed one. Refuses another store's, manifest's or format's directory."""
    identity = _identity(url, store, fmt)
    m = store.manifest
    doc = {
        "export_version": EXPORT_VERSION,
        **identity,
        "final_states": m.final_states,
        "layer_ids": list(m.layer_ids),
        "layout": _layout(fmt),
        "notes": _notes(store, fmt),
        "num_planned_samples": int(store.num_samples),
    }
    if fmt == "specforge":
        doc["specforge_aux_layers"] = _specforge_layers(m)
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
        old = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ExportConflict(f"{path}: unreadable ({exc}); refusing to write into {out}") from exc
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
    return doc


def _differences(old: dict, new: dict) -> list[str]:
    out = []
    if old.get("export_version") != EXPORT_VERSION:
        out.append(f"export_version {old.get('export_version')!r} (this code writes 1)")
    for key in ("format", "store_url", "job"):
        if old.get(key) != new[key]:
            out.append(f"{key} {old.get(key)!r} there, {new[key]!r} here")
    old_m, new_m = old.get("manifest") or {}, new["manifest"]
    fields = sorted(k for k in set(old_m) | set(new_m) if old_m.get(k) != new_m.get(k))
    if fields:
        out.append(f"manifest differs in {', '.join(fields)}")
    return out


def _layout(fmt: str) -> dict[str, str]:
    if fmt == "specforge":
        return {
            "files": f"rows_{{g}}-{{g+{SPECFORGE_GROUP}}}/data_{{index}}.ckpt",
            "index": "the store's global sample index",
            "keys": "input_ids int64 [T], loss_mask int64 [T], hidden_state [1,T,H], "
            "aux_hidden_state [1,T,num_aux*H]",
        }
    return {
        "files": "hidden_states/hs_{index}.safetensors",
        "index": "the store's global sample index = the row of the dataset in this directory",
        "keys": "hidden_states [T,num_aux+1,H] (aux layers, then final), token_ids int64 [T]",
        "dataset": "datasets.load_from_disk(DIR): input_ids, loss_mask, seq_len per planned sample",
    }


@functools.lru_cache(maxsize=4)
def _cached_ids(path: str, mtime_ns: int, fmt: str) -> dict[int, str]:
    doc = json.loads(Path(path).read_text())
    if doc.get("format") != fmt:
        raise ExportError(f"{path}: a {doc.get('format')!r} export, not {fmt!r}")
    return {int(i): str(sid) for i, sid in doc["exported"]}


def _exported_ids(path: Path, fmt: str) -> dict[int, str]:
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
