"""The fault campaign's check of its bad_rows job (tools/campaign_bad_rows.py), on a correct case
(it passes) and on each wrong one it exists for (it fails, naming the row): a bad row accepted,
rejected twice or for another reason, a good row rejected, a report whose rejects are not the
store's. And the job's input: every bad row expected once, by the id its reject will carry."""

from __future__ import annotations

import json
from pathlib import Path

from tools.campaign_bad_rows import Expected, check_rejects, write_input

BAD = [Expected("surrogate", r"^text holds a lone UTF-16 surrogate"), Expected("f.jsonl:3", "JSON")]
REJECTED = [
    {"sample_id": "surrogate", "reason": "text holds a lone UTF-16 surrogate (U+D83D ...)"},
    {"sample_id": "f.jsonl:3", "reason": "malformed JSON: nested too deep"},
]


def report(rejected: list[dict[str, str]]) -> dict:
    return {"rejected": rejected, "samples": {"rejected_at_plan": len(rejected)}}


def test_the_rejects_check_passes_the_right_rejects_and_names_each_wrong_one() -> None:
    assert check_rejects(REJECTED, report(REJECTED), BAD) == []
    accepted = REJECTED[1:]
    assert check_rejects(accepted, report(accepted), BAD) == [
        "bad row surrogate: rejected 0 times, not once"
    ]
    twice = [*REJECTED, REJECTED[0]]
    assert check_rejects(twice, report(twice), BAD) == [
        "bad row surrogate: rejected 2 times, not once"
    ]
    other = [{**REJECTED[0], "reason": "empty text"}, REJECTED[1]]
    assert check_rejects(other, report(other), BAD) == [
        "bad row surrogate: rejected for 'empty text', not /^text holds a lone UTF-16 surrogate/"
    ]
    good = [*REJECTED, {"sample_id": "chat-1", "reason": "zero tokens"}]
    assert check_rejects(good, report(good), BAD) == [
        "row chat-1 rejected, a good one: ['zero tokens']"
    ]
    assert check_rejects(REJECTED, report(REJECTED[:1]), BAD) == [
        "the report's rejects (1) are not the store's (2)"
    ]


def test_the_input_expects_each_bad_row_once_by_its_rejects_id(tmp_path: Path) -> None:
    good = [{"id": f"chat-{k}", "text": "hi"} for k in range(6)]
    mixed = write_input(tmp_path / "in.jsonl", good, tmp_path / "out.png", "http://x/d.png", True)
    lines = (tmp_path / "in.jsonl").read_bytes().splitlines()
    ids = []
    for number, line in enumerate(lines, 1):
        try:
            ids.append(json.loads(line)["id"])
        except (ValueError, RecursionError):  # a line no planner reads: named by its place
            ids.append(f"in.jsonl:{number}")
    bad = [row.sample_id for row in mixed.bad]
    assert len(set(bad)) == len(bad) and set(bad) <= set(ids)
    assert [row["id"] for row in mixed.good] == [i for i in ids if i not in set(bad)]
    assert mixed.data["image_roots"] == [str(tmp_path), "/dev"]
