"""What a store says about its job (`python -m cluster status`; its parser: cluster/cli.py),
from any machine that can read it, while the job runs or after it.

It reads the store alone: the plan, the commit markers and the shard summaries (one read of
each small per-shard array a look), never the hidden states. Rates come from the summaries'
wall-clock commit times, so they are the job's, whichever machine asks.
"""

from __future__ import annotations

import datetime
import json
import sys
import time
from collections.abc import Mapping
from typing import Any

import numpy as np
from zarr.errors import GroupNotFoundError

from hsx_store.format import Store, StoreFormatError
from hsx_store.location import StoreAccessError

RECENT_S = 300.0  # "the last minutes" of the recent rate


def job_status(
    url: str, storage_options: Mapping[str, Any] | None = None, now: float | None = None
) -> dict[str, Any]:
    """The job's state as its store holds it, as JSON-able counts."""
    store = Store.open(url, storage_options=storage_options)
    now = time.time() if now is None else now
    committed = store.committed()
    texts = np.asarray(store.array("shard_summary")[: len(store.shards)])
    summaries = [json.loads(str(texts[k])) for k in np.flatnonzero(committed)]
    report = store.group.attrs.get("report")  # read as the store was opened, just now
    extent = {sh.index: sh.token_end - sh.token_begin for sh in store.shards}
    tokens = sum(extent[s["shard"]] for s in summaries)
    tokens_planned = int(store.sample_length.sum())
    failed = [
        {"sample_id": sample_id, "reason": reason}
        for s in sorted(summaries, key=lambda s: s["shard"])
        for sample_id, reason in s["failed"].items()
    ]
    # Wall-clock commit times (the workers'), and when each committed shard was started.
    timed = [
        (float(s["finished_at"]), float(s.get("seconds", 0)), s)
        for s in summaries
        if "finished_at" in s
    ]
    first_start = min((end - took for end, took, _ in timed), default=None)
    last_commit = max((end for end, _, _ in timed), default=None)
    recent = sum(extent[s["shard"]] for end, _, s in timed if end >= now - RECENT_S)
    recent_span = min(RECENT_S, now - first_start) if first_start is not None else 0.0
    recent_rate = recent / recent_span if recent_span > 0 else None
    timed_tokens = sum(extent[s["shard"]] for _, _, s in timed)
    overall_span = (
        last_commit - first_start if last_commit is not None and first_start is not None else 0.0
    )
    complete = store.planned and bool(committed.all())
    ended = _ended_at(report)
    running = not complete and (ended is None or (last_commit is not None and last_commit > ended))
    eta = None
    if running and store.planned and recent_rate:
        eta = round((tokens_planned - tokens) / recent_rate, 1)
    return {
        "store": str(url),
        "state": "complete" if complete else "running" if running else "ended",
        "planning": "done" if store.planned else "in progress",
        "shards": {"planned": len(store.shards), "committed": int(committed.sum())},
        "samples": {
            "planned": store.num_samples,
            "written": sum(int(s["written"]) for s in summaries),
            "failed": len(failed),
            "rejected_at_plan": len(store.rejected),
        },
        "tokens": {"planned": tokens_planned, "committed": tokens},
        "gb_written": round(sum(int(s.get("bytes_written", 0)) for s in summaries) / 1e9, 4),
        "tokens_per_s": {
            f"last_{RECENT_S / 60:.0f}_min": None if recent_rate is None else round(recent_rate, 1),
            "since_start": round(timed_tokens / overall_span, 1) if overall_span > 0 else None,
        },
        "eta_s": eta,
        "last_commit_s_ago": None if last_commit is None else round(now - last_commit, 1),
        "last_run": None
        if report is None
        else {"ok": report.get("ok"), "ended": report.get("finished_at")},
        "failed": failed,
        "rejected": store.rejected,
    }


def _ended_at(report: Any) -> float | None:
    """When the store's last finished run ended (its report's wall-clock time)."""
    if not isinstance(report, Mapping) or "finished_at" not in report:
        return None
    return datetime.datetime.fromisoformat(str(report["finished_at"])).timestamp()


def format_status(status: Mapping[str, Any]) -> str:
    s, sh, tok = status["samples"], status["shards"], status["tokens"]
    rates = ", ".join(
        f"{'-' if v is None else f'{v:,.0f}'} tok/s {k.replace('_', ' ')}"
        for k, v in status["tokens_per_s"].items()
    )
    eta = status["eta_s"]
    lines = [
        f"{status['store']}: {status['state']} (planning {status['planning']})",
        f"  shards   {sh['committed']:,} / {sh['planned']:,} committed",
        f"  samples  {s['written']:,} / {s['planned']:,} written, {s['failed']:,} failed, "
        f"{s['rejected_at_plan']:,} rejected at plan",
        f"  tokens   {tok['committed']:,} / {tok['planned']:,}, {status['gb_written']:.3f} GB",
        f"  rate     {rates}",
        f"  ETA      {'-' if eta is None else datetime.timedelta(seconds=round(eta))}",
    ]
    if status["last_commit_s_ago"] is not None:
        lines.append(f"  last commit {status['last_commit_s_ago']:.0f} s ago")
    if status["last_run"] is not None:
        run = status["last_run"]
        lines.append(f"  last run ended {run['ended']} (ok: {run['ok']})")
    for f in status["failed"][:20]:
        lines.append(f"  failed   {f['sample_id']}: {f['reason']}")
    if len(status["failed"]) > 20:
        lines.append(f"  failed   ... and {len(status['failed']) - 20} more")
    return "\n".join(lines)


def show_status(url: str, *, follow: bool, interval_s: float, as_json: bool) -> int:
    """Print the job's status (JSON, one object a look, if `as_json`), again every `interval_s`
    while it runs if `follow`. Exit status: 0 the job is complete, 1 not (yet), 2 not a
    readable store."""
    while True:
        try:
            status = job_status(url)
        except (FileNotFoundError, GroupNotFoundError):
            print(f"error: no store at {url}", file=sys.stderr, flush=True)
            return 2
        except (StoreFormatError, StoreAccessError) as exc:
            print(f"error: {exc}", file=sys.stderr, flush=True)
            return 2
        print(json.dumps(status) if as_json else format_status(status), flush=True)
        if not follow or status["state"] != "running":
            return 0 if status["state"] == "complete" else 1
        time.sleep(interval_s)
