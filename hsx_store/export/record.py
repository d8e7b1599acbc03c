"""export.json: which store, manifest and format a directory's files came from (checked before
a resumed export adds to them), and which samples it holds."""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import Any

from hsx_store.export.base import ExportConflict, ExportError, TrainerFormat
from hsx_store.export.files import LOCK_NAME, TMP_MARK, write_atomic
from hsx_store.format import Store

EXPORT_JSON = "export.json"
# 2: store_id, hidden_dtype, last_slot; SpecForge always bf16, speculators' last slot pre-norm,
# token_freq.pt.
EXPORT_VERSION = 2


def begin(url: str, store: Store, trainer: TrainerFormat, sample_ids: list[str]) -> dict[str, Any]:
    """export.json at the start of a run: created for a fresh directory, checked (and kept) for
    a resumed one. Refuses another store's, manifest's or format's directory."""
    out = trainer.out
    identity = _identity(url, store, trainer)
    m = store.manifest
    doc = {
        "export_version": EXPORT_VERSION,
        **identity,
        "final_states": m.final_states,
        "layer_ids": list(m.layer_ids),
        "layout": trainer.layout(),
        "notes": trainer.notes(),
        "num_planned_samples": int(store.num_samples),
        **trainer.record_fields(),
    }
    path = out / EXPORT_JSON
    if not path.exists():
        strays = [p.name for p in out.iterdir() if p.name != LOCK_NAME and TMP_MARK not in p.name]
        if strays:
            raise ExportError(
                f"{out} is not empty ({', '.join(sorted(strays)[:5])}) and has no {EXPORT_JSON}: "
                f"not an export made here; refusing to write into it"
            )
        write_doc(out, {**doc, "exported": []})
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
        trainer.plan_grew()  # exported before the plan was complete (allowed once)
    return doc


def _identity(url: str, store: Store, trainer: TrainerFormat) -> dict[str, Any]:
    """What must be equal for a resumed export to add to a directory's files."""
    return json.loads(  # through JSON, as it is compared with a stored copy
        json.dumps(
            {
                "format": trainer.name,
                "store_url": _normal_url(url),
                # None for a store created before store ids: its URL, manifest and job only.
                "store_id": store.group.attrs.get("store_id"),
                "manifest": store.manifest.to_json(),
                "job": store.job,
                "hidden_dtype": trainer.hidden_dtype(),
                "last_slot": trainer.last_slot,
            }
        )
    )


def _normal_url(url: str) -> str:
    return url if "://" in url else os.path.abspath(url)


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


def exported_ids(out: Path, fmt: str) -> tuple[dict[int, str], str | None]:
    """The samples a `fmt` export in `out` holds ({index: sample id}) and its last_slot."""
    path = out / EXPORT_JSON
    return _cached_ids(str(path), path.stat().st_mtime_ns, fmt)


@functools.lru_cache(maxsize=4)
def _cached_ids(path: str, mtime_ns: int, fmt: str) -> tuple[dict[int, str], str | None]:
    doc = read_doc(Path(path))
    if doc.get("format") != fmt:
        raise ExportError(f"{path}: a {doc.get('format')!r} export, not {fmt!r}")
    return {int(i): str(sid) for i, sid in doc["exported"]}, doc.get("last_slot")


def write_doc(out: Path, doc: dict) -> None:
    """Readable header, then `exported` as one compact line (it can hold millions of pairs)."""
    head = json.dumps({k: v for k, v in doc.items() if k != "exported"}, indent=1)
    pairs = json.dumps(doc["exported"], separators=(",", ":"), ensure_ascii=False)
    blob = f'{head[:-2]},\n "exported": {pairs}\n}}\n'.encode()
    write_atomic(out / EXPORT_JSON, lambda f: f.write(blob))
