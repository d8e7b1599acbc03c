"""The job's live progress line and its final report.

The report is built from the store, not from what the driver saw: the store is the truth a
reader gets, and a resumed job reports on every shard, whichever run committed it.
"""

from __future__ import annotations

import datetime
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from cluster.generation_stats import GenerationStats
from hsx_store.format import STATUS_WRITTEN, Store


def _duration(seconds: float) -> str:
    return str(datetime.timedelta(seconds=round(seconds)))


def bar(fraction: float, width: int = 24) -> str:
    filled = round(max(0.0, min(1.0, fraction)) * width)
    return "[" + "#" * filled + "." * (width - filled) + "]"


@dataclass
class ProgressMeter:
    """Rates over this run's working time (from the first sample written, so server startup
    does not dilute them); shards committed by an earlier run count as done up front."""

    total_samples: int
    total_tokens: int
    done_samples: int = 0  # committed before this run
    done_tokens: int = 0
    started: float = field(default_factory=time.monotonic)
    working_since: float | None = None
    planning: bool = False  # the totals still grow as shards are planned
    generation: GenerationStats | None = None  # a `generate:` job's, as its parts are planned

    def line(
        self,
        completed: list[dict[str, Any]],
        in_flight_samples: int,
        workers: dict[str, int],
        now: float | None = None,
    ) -> str:
        """`completed`: summaries of shards completed in this run; `in_flight_samples`: samples
        written so far in shards still running; `workers`: how many are in each phase."""
        now = time.monotonic() if now is None else now
        samples = self.done_samples + sum(s["samples"] for s in completed) + in_flight_samples
        if self.working_since is None and samples > self.done_samples:
            self.working_since = now
        working = now - self.working_since if self.working_since is not None else 0.0
        tokens = sum(s["tokens"] for s in completed)
        failed = sum(len(s["failed"]) for s in completed)
        rate = tokens / working if working > 0 else 0.0
        gbps = sum(s["bytes_written"] for s in completed) / working / 1e9 if working > 0 else 0.0
        remaining = self.total_tokens - self.done_tokens - tokens
        eta = _duration(remaining / rate) if rate > 0 else "?"
        if self.total_samples:
            fraction = min(1.0, samples / self.total_samples)
        else:  # nothing planned yet, or nothing to do
            fraction = 0.0 if self.planning else 1.0
        phases = ", ".join(f"{n} {phase}" for phase, n in sorted(workers.items()))
        generated = ""
        if (g := self.generation) is not None:
            generated = (
                f" | generated {g.responses} responses in {g.parts_done}/{g.parts} parts, "
                f"{g.generated_tokens:,} tokens"
            )
        return (
            f"{bar(fraction)} {fraction:4.0%} samples {samples}/{self.total_samples}"
            f"{' (planning)' if self.planning else ''}{generated}"
            f"{f' ({failed} failed)' if failed else ''} | {rate:,.0f} tok/s | {gbps:.3f} GB/s | "
            f"workers: {phases or 'none'} | elapsed {_duration(now - self.started)} | ETA {eta}"
        )


def build_report(store: Store, run: dict[str, Any]) -> dict[str, Any]:
    """The store's state as a JSON-able report; `run` holds what only the driver knows (this
    run's timing, lost workers, shards given up)."""
    committed = store.committed()
    status = np.asarray(store.group["sample_status"][:])
    summaries = {k: store.summary(k) for k in np.flatnonzero(committed).tolist()}
    failed = [
        {"sample_id": sample_id, "reason": reason}
        for k in sorted(summaries)
        for sample_id, reason in summaries[k]["failed"].items()
    ]
    workers: dict[str, dict[str, Any]] = defaultdict(
        lambda: {"shards": 0, "samples": 0, "tokens": 0, "seconds": 0.0, "server_restarts": 0}
    )
    for s in summaries.values():
        w = workers[s.get("worker", "?")]
        w["shards"] += 1
        w["samples"] += s["samples"]
        w["tokens"] += s.get("tokens", 0)
        w["seconds"] = round(w["seconds"] + s.get("seconds", 0.0), 3)
        w["server_restarts"] = max(w["server_restarts"], s.get("server_restarts", 0))
    uncommitted = [sh for sh in store.shards if not committed[sh.index]]
    not_done = sum(sh.sample_end - sh.sample_begin for sh in uncommitted)
    rejected = store.rejected
    seconds = run.get("seconds") or 0.0
    tokens_this_run = sum(s["tokens"] for s in run.get("completed", []))
    bytes_this_run = sum(s["bytes_written"] for s in run.get("completed", []))
    return {
        "store": str(run.get("store_url", "")),
        "finished_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "ok": not failed and not uncommitted,
        "samples": {
            "planned": store.num_samples,
            "written": int((status == STATUS_WRITTEN).sum()),
            "failed": len(failed),
            "not_committed": not_done,
            "rejected_at_plan": len(rejected),
        },
        "shards": {
            "total": len(store.shards),
            "committed": int(committed.sum()),
            "not_committed": [sh.index for sh in uncommitted],
            "given_up": run.get("given_up", {}),
        },
        "tokens": {
            "planned": int(store.sample_length.sum()),
            "committed": int(
                sum(
                    store.sample_length[sh.sample_begin : sh.sample_end].sum()
                    for sh in store.shards
                    if committed[sh.index]
                )
            ),
        },
        "run": {
            "resumed": bool(run.get("resumed")),
            "seconds": round(seconds, 1),
            "shards_committed": len(run.get("completed", [])),
            "tokens_per_s": round(tokens_this_run / seconds, 1) if seconds else None,
            "gb_per_s": round(bytes_this_run / seconds / 1e9, 4) if seconds else None,
            "workers_lost": run.get("workers_lost", []),
            "planning": run.get("planning"),  # None: the plan was complete before this run
        },
        "workers": dict(workers),
        # PUTs object storage answered 503 SlowDown, retried (actors/shard_writer.py counts them)
        "throttled_requests": sum(s.get("throttled_requests", 0) for s in summaries.values()),
        "failed_samples": failed,
        "rejected": rejected,
    }


def format_report(report: dict[str, Any]) -> str:
    s, sh, run = report["samples"], report["shards"], report["run"]
    rows = [
        ("result", "OK" if report["ok"] else "INCOMPLETE OR FAILED SAMPLES"),
        ("store", report["store"]),
        ("samples written", f"{s['written']} / {s['planned']}"),
        ("samples failed", s["failed"]),
        ("samples not committed", s["not_committed"]),
        ("rejected at plan", s["rejected_at_plan"]),
        ("shards committed", f"{sh['committed']} / {sh['total']}"),
        (
            "tokens committed",
            f"{report['tokens']['committed']:,} / {report['tokens']['planned']:,}",
        ),
        (
            "this run",
            f"{run['shards_committed']} shards in {_duration(run['seconds'])}"
            f"{' (resumed)' if run['resumed'] else ''}",
        ),
        ("this run tok/s", run["tokens_per_s"]),
        ("this run GB/s", run["gb_per_s"]),
        ("workers lost", len(run["workers_lost"])),
        ("throttled requests", f"{report['throttled_requests']} (503 SlowDown, retried)"),
    ]
    if generation := (run["planning"] or {}).get("generation"):
        reasons = ", ".join(f"{k} {v}" for k, v in sorted(generation["finish_reasons"].items()))
        rows += [
            (
                "generated",
                f"{generation['responses']} responses to {generation['prompts']} prompts "
                f"({generation['reused_parts']} of {generation['parts']} parts kept from an "
                f"earlier run); finish: {reasons or 'none'}",
            ),
            ("generated tokens", f"{generation['generated_tokens']:,}"),
            ("generated tok/s", generation["generated_tokens_per_s"]),
        ]
    width = max(len(k) for k, _ in rows)
    lines = ["", "== hidden-state extraction report =="]
    lines += [f"{k:<{width}}  {v}" for k, v in rows]
    if report["workers"]:
        lines.append(f"{'worker':<40} {'shards':>6} {'samples':>8} {'tok/s':>10} {'restarts':>8}")
        for name, w in sorted(report["workers"].items()):
            rate = w["tokens"] / w["seconds"] if w["seconds"] else 0
            lines.append(
                f"{name:<40} {w['shards']:>6} {w['samples']:>8} {rate:>10,.0f} "
                f"{w['server_restarts']:>8}"
            )
    for f in report["failed_samples"][:20]:
        lines.append(f"failed {f['sample_id']}: {f['reason']}")
    for r in report["rejected"][:20]:
        lines.append(f"rejected {r['sample_id']}: {r['reason']}")
    for k, reasons in report["shards"]["given_up"].items():
        lines.append(f"shard {k} given up: {'; '.join(reasons)}")
    return "\n".join(lines)
