"""What the fault campaign checks of a `generate:` job, after it ran through the faults
(tools/fault_campaign.py runs it; each check takes plain data, so a unit test can hand it a
broken case and see it fail).

- `planned_once`: every prompt's n samples are in exactly one part's responses, the parts are
  the prompts in input order, and the store holds each sample once, in that order (or rejects
  it once, with the reason the plan gives).
- `written_once`: each responses object has one version in the (versioned) bucket: one PUT
  landed. A part's responses are written once, whoever generated them.
- `never_regenerated`: a PUT of a part's responses with other bytes than those stored is
  another generation of the part; it must have begun before the stored one landed (a claimant
  lost mid-write, its write still in flight), never after: a kept part is not generated again.
- `from_records`: each stored sample is its prompt's segments and the turns its stored
  responses hold (the tokens the server returned), nothing else.
- `greedy_mismatches`: a greedy (float32) job's responses are the greedy decode of the HF
  float32 reference: every generated token its argmax given the tokens before it, no stop
  token before a turn's end, a turn cut exactly at max_new_tokens. Token by token, that makes
  each response the one an undisturbed greedy run writes; the n samples of a prompt are equal.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tools.fault_injection import Request

RESPONSES_KEY = re.compile(r"generation/responses-(\d+)\.json$")
# A responses object's upload, as the proxy sees its request line: what a mid-claim kill holds.
RESPONSES_PUT = re.compile(rb"^PUT \S*/generation/responses-\d+\.json")
LANDED_RESOLUTION_S = 1.0  # S3's LastModified is whole seconds: landed in [modified, modified + 1)


@dataclass(frozen=True)
class StoredVersion:
    """One version of an object in a versioned bucket: one PUT that landed."""

    key: str  # relative to the store's root: generation/responses-00000003.json
    etag: str  # the body's MD5 (a single PUT's), without quotes
    modified: float  # epoch seconds, whole


def part_of(key: str) -> int | None:
    match = RESPONSES_KEY.search(key)
    return None if match is None else int(match.group(1))


def stored_versions(client: Any, bucket: str, prefix: str) -> dict[str, list[StoredVersion]]:
    """Every version of every object under `prefix` (the store's `generation/` folder), by key
    relative to the store's root, oldest first."""
    found: dict[str, list[StoredVersion]] = {}
    root = prefix.rsplit("generation/", 1)[0]
    for page in client.get_paginator("list_object_versions").paginate(Bucket=bucket, Prefix=prefix):
        for v in page.get("Versions", []):
            key = v["Key"].removeprefix(root)
            version = StoredVersion(key, v["ETag"].strip('"'), v["LastModified"].timestamp())
            found.setdefault(key, []).append(version)
    return {k: sorted(vs, key=lambda v: v.modified) for k, vs in found.items()}


def expected_parts(prompt_ids: list[str], n: int, samples_per_shard: int) -> list[list[str]]:
    """The sample ids of each part, as the driver cuts them (cluster/generation_feed.py)."""
    per_part = max(1, samples_per_shard // n)
    ids = [[p] if n == 1 else [f"{p}#{k}" for k in range(n)] for p in prompt_ids]
    return [[s for p in ids[i : i + per_part] for s in p] for i in range(0, len(ids), per_part)]


def planned_once(
    parts: list[list[str]],
    records: Mapping[int, Mapping[str, Any]],
    store_ids: list[str],
    rejected: list[Mapping[str, str]],
) -> list[str]:
    problems = []
    if sorted(records) != list(range(len(parts))):
        missing = sorted(set(range(len(parts))) - set(records))
        extra = sorted(set(records) - set(range(len(parts))))
        problems.append(f"parts with responses: missing {missing}, not planned {extra}")
    for k, record in sorted(records.items()):
        got = [s["sample_id"] for s in record["samples"]]
        if k < len(parts) and got != parts[k]:
            problems.append(f"part {k}'s responses are for {got[:4]}..., not {parts[k][:4]}...")
    expected = [s for part in parts for s in part]
    rejects = Counter(r["sample_id"] for r in rejected)
    counts = Counter(store_ids)
    for sample_id in expected:
        times = counts[sample_id] + rejects[sample_id]
        if times != 1:
            problems.append(
                f"sample {sample_id}: planned {counts[sample_id]} time(s), rejected "
                f"{rejects[sample_id]} time(s); once in all"
            )
    if unknown := sorted(set(counts) - set(expected)):
        problems.append(f"samples in the store that no prompt has: {unknown[:5]}")
    in_order = [s for s in expected if counts[s]]
    if store_ids != in_order and not unknown:
        problems.append("the store's samples are not in the prompts' order")
    return problems


def written_once(versions: Mapping[str, list[StoredVersion]]) -> list[str]:
    """A responses object with more than one version was written more than once."""
    return [
        f"{key} written {len(vs)} times (ETags {', '.join(v.etag[:8] for v in vs)}); "
        "a part's responses are written once"
        for key, vs in sorted(versions.items())
        if part_of(key) is not None and len(vs) > 1
    ]


def never_regenerated(
    puts: Iterable[Request], versions: Mapping[str, list[StoredVersion]]
) -> tuple[list[str], int]:
    """(problems, parts generated again before their first responses landed). `puts`: the
    PUTs of responses objects the proxy read, with their bodies, retries and refused ones too;
    a stored object none of them uploaded is a problem too (the check would be blind to it)."""
    problems: list[str] = []
    early: set[int] = set()
    parts = {k: part for k in versions if (part := part_of(k)) is not None}
    seen: set[str] = set()  # keys whose stored upload the proxy read
    for put in puts:
        key = next((k for k in parts if put.target.endswith("/" + k)), None)
        if key is None or put.body is None:
            continue
        stored = versions[key][0]
        if hashlib.md5(put.body).hexdigest() == stored.etag:
            seen.add(key)
            continue  # the stored generation (a retried request of it)
        started = float(json.loads(put.body).get("started_at", 0.0))
        if started >= stored.modified + LANDED_RESOLUTION_S:
            problems.append(
                f"{key}: generated again at {started:.1f} (worker "
                f"{json.loads(put.body).get('worker')}), after its responses were stored at "
                f"{stored.modified:.0f}: a kept part is never generated again"
            )
        else:
            early.add(parts[key])
    problems += [
        f"{key}: the proxy read no upload of its stored bytes, so its uploads cannot be judged"
        for key in sorted(set(parts) - seen)
    ]
    return problems, len(early)


def turns_of(sample: Mapping[str, Any]) -> tuple[list[int], list[int], list[tuple[int, int]]]:
    """A responses entry as the store must hold it: (ids, loss mask, each turn's (first, end)
    positions of the tokens the server returned): segment, turn, segment, turn ... (a turn cut
    at max_new_tokens ends it), each stopped turn closed by the turn end if it lacks it."""
    ids: list[int] = []
    mask: list[int] = []
    spans = []
    end = list(sample["turn_end"])
    for segment, turn in zip(sample["segments"], sample["turns"], strict=False):
        ids += segment
        mask += [0] * len(segment)
        written = list(turn["output_ids"])
        spans.append((len(ids), len(ids) + len(written)))
        if turn["finish_reason"] == "stop" and end and written[-len(end) :] != end:
            written += end
        ids += written
        mask += [1] * len(written)
    return ids, mask, spans


def from_records(
    records: Mapping[int, Mapping[str, Any]],
    stored: Callable[[str], tuple[list[int], list[int]] | None],
) -> list[str]:
    """Each generated sample's stored (ids, loss mask), `stored(sample_id)` (None: not in the
    store), against its responses."""
    problems = []
    for record in records.values():
        for sample in record["samples"]:
            if "error" in sample or (got := stored(sample["sample_id"])) is None:
                continue
            ids, mask, _ = turns_of(sample)
            if got != (ids, mask):
                problems.append(
                    f"sample {sample['sample_id']}: the store's tokens are not its prompt and "
                    "the turns its kept responses hold"
                )
    return problems


@dataclass(frozen=True)
class Greedy:
    """What a greedy response must be: the reference model, its stop tokens, the cut."""

    logits: Callable[[list[int]], torch.Tensor]  # ids -> [T, vocab] logits, float32
    eos_ids: frozenset[int]  # the server stops at these and at the sample's turn end
    max_new_tokens: int


def greedy_mismatches(
    records: Mapping[int, Mapping[str, Any]], greedy: Greedy
) -> tuple[list[str], float]:
    """(problems, the narrowest top-1/top-2 logit gap at a generated token: how near a tie the
    comparison came)."""
    problems: list[str] = []
    narrowest = float("inf")
    by_prompt: dict[str, Any] = {}
    for record in records.values():
        for sample in record["samples"]:
            if "error" in sample:
                continue
            prompt = sample["sample_id"].split("#")[0]
            turns = [t["output_ids"] for t in sample["turns"]]
            first = by_prompt.setdefault(prompt, (sample["sample_id"], turns))
            if first[1] != turns:
                problems.append(
                    f"samples {first[0]} and {sample['sample_id']}: greedy responses to one "
                    "prompt differ"
                )
                continue
            if first[0] != sample["sample_id"]:
                continue  # the same tokens: checked once
            issue, gap = _one_greedy(sample, greedy)
            narrowest = min(narrowest, gap)
            if issue:
                problems.append(f"sample {sample['sample_id']}: {issue}")
    return problems, narrowest


def _one_greedy(sample: Mapping[str, Any], greedy: Greedy) -> tuple[str | None, float]:
    ids, _, spans = turns_of(sample)
    logits = greedy.logits(ids)
    stop_ids = greedy.eos_ids | set(sample["turn_end"][:1])
    narrowest = float("inf")
    for k, ((begin, end), turn) in enumerate(zip(spans, sample["turns"], strict=True)):
        for p in range(begin, end):
            top = torch.topk(logits[p - 1], 2)
            narrowest = min(narrowest, float(top.values[0] - top.values[1]))
            if ids[p] != int(top.indices[0]):
                gap = float(logits[p - 1, top.indices[0]] - logits[p - 1, ids[p]])
                return (
                    f"turn {k}, token {p - begin}: wrote {ids[p]}, the reference's argmax is "
                    f"{int(top.indices[0])} (logit gap {gap:.3g})"
                ), narrowest
        written = turn["output_ids"]
        if early := [t for t in written[:-1] if t in stop_ids]:
            return f"turn {k}: stop token {early[0]} before its end", narrowest
        if turn["finish_reason"] == "length" and len(written) != greedy.max_new_tokens:
            return f"turn {k}: cut at {len(written)} tokens, not {greedy.max_new_tokens}", narrowest
        if turn["finish_reason"] == "stop" and written[-1:] and written[-1] not in stop_ids:
            return f"turn {k}: stopped after {written[-1]}, which is no stop token", narrowest
    return None, narrowest


@dataclass(frozen=True)
class Generated:
    """What the checks found of one generate job."""

    problems: list[str]
    rewritten: int  # responses objects written more than once
    regenerated: int  # kept parts generated again
    summary: str


def check_generated(
    store: Any,
    prompt_ids: list[str],
    generate: Mapping[str, Any],
    samples_per_shard: int,
    versions: Mapping[str, list[StoredVersion]],
    puts: list[Request],
    greedy_model: Path | None,
) -> Generated:
    """Every check above, on a finished generate job's store (hsx_store.format.Store), the
    versions of its `generation/` objects, the responses uploads the proxy read and, for a
    greedy job, the model (its HF float32 reference)."""
    from hsx_store.generated import GeneratedParts

    keep, g = GeneratedParts(store.group.store), store.group
    records = {k: keep.responses(k) for k in keep.parts()}
    ids = [str(x) for x in g["sample_id"][:]]
    parts = expected_parts(prompt_ids, int(generate["n"]), samples_per_shard)
    problems = planned_once(parts, records, ids, store.rejected)
    problems += [
        f"sample {r['sample_id']} rejected: {r['reason']}"
        for r in store.rejected
        if not r["reason"].startswith("empty response")  # what a model may write
    ]
    rewritten = written_once(versions)
    regenerated, early = never_regenerated(puts, versions)
    input_ids, loss_mask = np.asarray(g["input_ids"][:]), np.asarray(g["loss_mask"][:])
    index = {s: i for i, s in enumerate(ids)}

    def stored(sample_id: str) -> tuple[list[int], list[int]] | None:
        if (i := index.get(sample_id)) is None:
            return None
        rows = store.sample_rows(i)
        return input_ids[rows].tolist(), loss_mask[rows].tolist()

    problems += from_records(records, stored)
    summary = (
        f"{len(records)} parts, {len(puts)} uploads of responses read; {early} part(s) "
        "generated again after a claimant was lost mid-write, before its upload landed"
    )
    if greedy_model is not None:
        greedy = Greedy(*hf_reference(greedy_model), int(generate["max_new_tokens"]))
        mismatches, gap = greedy_mismatches(records, greedy)
        problems += mismatches
        summary += f"; greedy: narrowest top-2 logit gap at a written token {gap:.3g}"
    return Generated(problems + rewritten + regenerated, len(rewritten), len(regenerated), summary)


def hf_reference(model: Path) -> tuple[Callable[[list[int]], torch.Tensor], frozenset[int]]:
    """The HF float32 reference's logits for a sequence, and its eos tokens."""
    from tests.helpers.hf_reference import reference_model

    hf = reference_model(model)
    eos = hf.generation_config.eos_token_id
    eos_ids = frozenset([eos] if isinstance(eos, int) else eos or [])

    def logits(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return hf(torch.tensor([ids])).logits[0].float()

    return logits, eos_ids
