"""The fault campaign's checks of a generate job (tools/campaign_generation.py), each on a correct
case (it passes) and on the wrong one it exists for (it fails): a sample planned twice or
never, a responses object written twice, a kept part generated again, a stored sample that is
not its responses, a greedy response that is not the reference's greedy decode."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest

from tools.campaign_generation import (
    Greedy,
    StoredVersion,
    expected_parts,
    from_records,
    greedy_mismatches,
    hf_reference,
    never_regenerated,
    planned_once,
    turns_of,
    written_once,
)
from tools.fault_injection import Request

KEY = "generation/responses-00000000.json"
TURN_END = [4]


def sample(sample_id: str, *turns: list[int], finish: str = "length") -> dict[str, Any]:
    return {
        "sample_id": sample_id,
        "segments": [[1, 2, 3], [5, 6]][: len(turns)],
        "turn_end": TURN_END,
        "turns": [{"output_ids": t, "finish_reason": finish, "text": ""} for t in turns],
    }


def records_of(parts: list[list[str]]) -> dict[int, dict[str, Any]]:
    return {k: {"samples": [sample(s, [9, 9]) for s in part]} for k, part in enumerate(parts)}


def test_planned_once_passes_each_sample_once_and_fails_a_double_or_a_missing_one() -> None:
    parts = expected_parts(["a", "b", "c"], 2, samples_per_shard=4)
    assert parts == [["a#0", "a#1", "b#0", "b#1"], ["c#0", "c#1"]]
    records = records_of(parts)
    ids = [s for p in parts for s in p]
    assert planned_once(parts, records, ids, []) == []
    empty = [{"sample_id": "b#1", "reason": "empty response (turn 0)"}]
    assert planned_once(parts, records, [s for s in ids if s != "b#1"], empty) == []
    assert "planned 2 time(s)" in planned_once(parts, records, [*ids, "c#1"], [])[0]
    assert "planned 0 time(s)" in planned_once(parts, records, ids[:-1], [])[0]
    assert "planned 1 time(s), rejected 1" in planned_once(parts, records, ids, empty)[0]
    swapped = [ids[1], ids[0], *ids[2:]]
    assert planned_once(parts, records, swapped, []) == [
        "the store's samples are not in the prompts' order"
    ]
    other = {0: records[0], 1: {"samples": [sample("a#0", [9])]}}
    assert "part 1's responses are for ['a#0']" in planned_once(parts, other, ids, [])[0]
    assert "missing [1]" in planned_once(parts, {0: records[0]}, ids, [])[0]


def version(key: str, body: bytes, modified: float) -> StoredVersion:
    return StoredVersion(key, hashlib.md5(body).hexdigest(), modified)


def upload(body: bytes, at: float = 0.0) -> Request:
    return Request(at, "PUT", f"/bucket/g.zarr/{KEY}", body, 5555)


def test_written_once_fails_a_responses_object_with_two_versions() -> None:
    first = version(KEY, b"one", 100.0)
    prompts = "generation/prompts-00000000.json"
    assert written_once({KEY: [first], prompts: [first, first]}) == []  # prompts: a resume's
    twice = written_once({KEY: [first, version(KEY, b"two", 130.0)]})
    assert len(twice) == 1 and f"{KEY} written 2 times" in twice[0]


def test_never_regenerated_tells_a_lost_claimants_successor_from_a_regenerated_kept_part() -> None:
    stored = json.dumps({"started_at": 90.0, "worker": "w1"}).encode()
    versions = {KEY: [version(KEY, stored, 100.0)]}
    retry = [upload(stored), upload(stored)]  # a retried upload of the stored generation
    assert never_regenerated(retry, versions) == ([], 0)
    # Began before the stored upload landed (its writer lost mid-write, the upload in flight).
    before = json.dumps({"started_at": 100.5, "worker": "w2"}).encode()
    assert never_regenerated([*retry, upload(before)], versions) == ([], 1)
    after = json.dumps({"started_at": 101.0, "worker": "w3"}).encode()
    problems, early = never_regenerated([upload(after)], versions)
    assert early == 0 and len(problems) == 2
    assert "generated again at 101.0 (worker w3)" in problems[0]
    assert "read no upload of its stored bytes" in problems[1]  # blind: fails too


def test_from_records_fails_a_stored_sample_that_is_not_its_responses() -> None:
    entry = sample("a", [7, 8], [9], finish="stop")
    ids, mask, spans = turns_of(entry)
    assert ids == [1, 2, 3, 7, 8, 4, 5, 6, 9, 4]  # each stopped turn closed by the turn end
    assert mask == [0, 0, 0, 1, 1, 1, 0, 0, 1, 1] and spans == [(3, 5), (8, 9)]
    records = {0: {"samples": [entry, {**sample("b", [1]), "error": "gone"}]}}
    assert from_records(records, lambda s: (ids, mask) if s == "a" else None) == []
    wrong = [*ids[:-1], 8]
    problems = from_records(records, lambda s: (wrong, mask) if s == "a" else None)
    assert problems and "sample a:" in problems[0]


@pytest.fixture(scope="module")
def greedy(llama_path: Path) -> Greedy:
    logits, eos_ids = hf_reference(llama_path)
    return Greedy(logits, eos_ids, max_new_tokens=6)


def decode(greedy: Greedy, prompt: list[int], stop: set[int]) -> tuple[list[int], str]:
    """The reference's own greedy decode, a token at a time."""
    ids: list[int] = []
    while len(ids) < greedy.max_new_tokens:
        ids.append(int(greedy.logits(prompt + ids)[-1].argmax()))
        if ids[-1] in stop:
            return ids, "stop"
    return ids, "length"


def test_greedy_passes_the_references_decode_and_fails_a_token_off_it(greedy: Greedy) -> None:
    prompt = [1, 17, 230, 45, 99, 3]
    written, finish = decode(greedy, prompt, set(greedy.eos_ids) | set(TURN_END))
    entry = {**sample("p#0", written, finish=finish), "segments": [prompt]}
    records = {0: {"samples": [entry, {**entry, "sample_id": "p#1"}]}}
    problems, gap = greedy_mismatches(records, greedy)
    assert problems == [] and gap > 0
    off = [*written[:2], (written[2] + 1) % 1024, *written[3:]]
    wrong = {0: {"samples": [{**entry, "turns": [{**entry["turns"][0], "output_ids": off}]}]}}
    problems, _ = greedy_mismatches(wrong, greedy)
    assert len(problems) == 1 and "turn 0, token 2: wrote" in problems[0]
    apart = {0: {"samples": [entry, {**wrong[0]["samples"][0], "sample_id": "p#1"}]}}
    assert "greedy responses to one prompt differ" in greedy_mismatches(apart, greedy)[0][0]
    short = {**entry["turns"][0], "output_ids": written[:-1], "finish_reason": "length"}
    cut = {0: {"samples": [{**entry, "turns": [short]}]}}
    assert f"not {greedy.max_new_tokens}" in greedy_mismatches(cut, greedy)[0][0]
