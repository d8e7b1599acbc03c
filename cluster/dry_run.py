"""`python -m cluster run --config JOB.yaml --dry-run`: a job checked without running it.

The config is validated as `run` validates it; then the model files (config.json,
tokenizer.json and the weights the server loads: their identity is computed, as a store's
manifest records it), every input (it exists and its format reads) and `store.url` as `run`
checks it before it writes (cluster/job_store.py `probe_location`: a location that cannot take
a store, refused credentials, another job's store); the first parts are planned in this
process, and on until the first accepted sample (`run` makes no store for a job without one).
It prints the layers and the store's layout, the rejects so far and the storage estimate
projected from those parts. It starts no server and no Ray, and writes nothing. Every problem
is named; any one makes the exit status 2.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from cluster.config import ConfigError, JobConfig
from cluster.job_store import (
    ResumeConflict,
    check_resume,
    describe_capture,
    describe_estimate,
    manifest_for,
    no_usable_samples,
    probe_location,
)
from cluster.plan import PartEnd, PlanStream, Reject, Sample
from cluster.plan_sources import PlanError, resolve_source
from hsx_store.format import Manifest, StoreFormatError
from hsx_store.location import StoreAccessError

DRY_RUN_PARTS = 8  # planned, of about equal size each (cluster/plan_sources.py)
SHOWN_REJECTS = 20


def dry_run(config: JobConfig, say: Callable[[str], None] = print) -> int:
    model = Path(config.model.path)
    missing = [model / name for name in ("config.json", "tokenizer.json")]
    missing = [path for path in missing if not path.is_file()]
    problems = [f"model.path: {path} is missing" for path in missing]
    try:
        manifest = manifest_for(config, chat_template=None)
        say(describe_capture(manifest, config.store.url))
    except (ConfigError, OSError) as exc:
        manifest = None
        if not missing:  # otherwise it is a missing file, named above
            problems.append(f"model.path: {exc}")
    unreadable = []
    for path in config.data.paths:
        try:
            resolve_source(path, config.data.format)
        except (PlanError, OSError) as exc:
            unreadable.append(f"data.paths: {exc}")
    problems += unreadable
    # A resume is checked against the model and the inputs: only where both could be read.
    problems += _check_store(config, manifest is not None and not missing and not unreadable, say)
    if not unreadable and model / "tokenizer.json" not in missing:  # what planning needs
        problems += _plan_first_parts(config, manifest, say)
    for problem in problems:
        say(f"problem: {problem}")
    say(
        f"dry run: {len(problems)} problem(s); nothing was started or written"
        + ("" if problems else "; `run` without --dry-run starts the job")
    )
    return 2 if problems else 0


def _check_store(config: JobConfig, check_job: bool, say: Callable[[str], None]) -> list[str]:
    """`store.url` as `run` finds it before it writes: what it would do there, or the problem."""
    url = config.store.url
    try:
        store, interrupted = probe_location(url, config.store.storage_options)
        if store is not None and check_job:
            check_resume(store, config)
    except (StoreAccessError, StoreFormatError, ResumeConflict) as exc:
        return [f"store.url: {exc}"]
    if store is not None and not check_job:
        say(f"store: {url} holds a store, compared with this job once its model and inputs read")
    elif store is not None:
        done = int(store.committed().sum())
        plan = "its plan" if store.planned else "its plan, planned again (it was interrupted)"
        say(
            f"store: {url} is this job's, {done}/{len(store.shards)} shards committed: `run` "
            f"resumes it with {plan}"
        )
    elif interrupted:
        say(f"store: {url} holds a store whose creation was interrupted: `run` makes it anew")
    else:
        say(f"store: none at {url} yet: `run` makes it there")
    return []


def _plan_first_parts(
    config: JobConfig, manifest: Manifest | None, say: Callable[[str], None]
) -> list[str]:
    """Plan the first parts in this process (and on until the first sample), print what they
    hold; the problems found."""
    trust = config.model.trust_remote_code
    try:
        stream = PlanStream(config.data, config.model.path, trust, 0, config.generate)
    except (PlanError, OSError, ValueError) as exc:
        return [f"planning: {exc}"]
    samples = tokens = parts = 0
    rejects: list[Reject] = []
    for item in stream:
        if isinstance(item, Sample):
            samples, tokens = samples + 1, tokens + len(item.input_ids)
        elif isinstance(item, Reject):
            rejects.append(item)
        elif isinstance(item, PartEnd):
            parts += 1
            if parts >= DRY_RUN_PARTS and samples:
                break
    total = len(stream.parts)
    say(f"planned the first {parts} of {total} parts: {samples} samples, {tokens:,} tokens, "
        f"{len(rejects)} rejected")  # fmt: skip
    for reject in rejects[:SHOWN_REJECTS]:
        say(f"  rejected {reject.sample_id}: {reject.reason}")
    if len(rejects) > SHOWN_REJECTS:
        say(f"  ... and {len(rejects) - SHOWN_REJECTS} more")
    if manifest is not None and samples:
        scale = total / parts
        estimate = describe_estimate(
            manifest, round(samples * scale), round(tokens * scale), config.store.url
        )
        say(f"projected: {estimate}")
    if not samples:  # the whole data planned: `run` would make no store, and stop
        return [f"planning: {no_usable_samples([r.to_json() for r in rejects], 'rows')}"]
    return []
