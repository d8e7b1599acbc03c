"""`hsx draft-bench`'s arithmetic over SGLang's meta_info: per-position acceptance from the
correct-drafts histogram, the accept length over all requests, and the lossless check, which
passes equal outputs and fails a differing one. Serving: tests/integration/test_draft_convert.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cluster.draft_bench import Prompt, draft_dtype, per_position, summarize


def test_per_position_is_the_share_of_steps_with_at_least_k_correct_drafts() -> None:
    # 10 verify steps: 4 with no correct draft, 3 with one, 2 with two, 1 with all three.
    assert per_position([4, 3, 2, 1], 3) == pytest.approx([0.6, 0.3, 0.1])
    assert per_position([0, 0, 0, 0], 3) == [0.0, 0.0, 0.0]


def answer(tokens: list[int], histogram: list[int] | None = None) -> dict:
    meta = {"completion_tokens": len(tokens)}
    if histogram is not None:
        steps = sum(histogram)
        meta |= {"spec_correct_drafts_histogram": histogram, "spec_verify_ct": steps,
                 "spec_accept_length": len(tokens) / steps}  # fmt: skip
    return {"output_ids": tokens, "meta": meta, "seconds": 1.0}


def test_summarize_pools_requests_and_flags_a_differing_output() -> None:
    prompts = [Prompt("a", [1, 2]), Prompt("b", [3])]
    baseline = ([answer(list(range(8))), answer(list(range(4)))], 2.0)
    same = ([answer(list(range(8)), [1, 1, 2, 0]), answer(list(range(4)), [2, 0, 0, 0])], 1.0)
    report = summarize(baseline, same, prompts, 3)
    assert report["accept_length"] == pytest.approx(12 / 6)  # tokens over verify steps, pooled
    assert report["correct_drafts_histogram"] == [3, 1, 2, 0]
    assert report["per_position"] == pytest.approx([3 / 6, 2 / 6, 0.0])
    assert report["tokens_per_s"] == 12.0 and report["tokens_per_s_baseline"] == 6.0
    assert report["identical"] and report["identical_requests"] == 2
    differing = ([answer(list(range(8)), [1, 1, 2, 0]), answer([0, 1, 2, 9], [2, 0, 0, 0])], 1.0)
    report = summarize(baseline, differing, prompts, 3)
    assert not report["identical"] and report["identical_requests"] == 1
    assert [r["identical"] for r in report["requests"]] == [True, False]


def test_the_servers_dtype_is_the_drafts_own(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"dtype": "float32"}))
    assert draft_dtype(tmp_path) == "float32"
    (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": "bfloat16"}))
    assert draft_dtype(tmp_path) == "bfloat16"
    with pytest.raises(ValueError, match="not a draft directory"):
        draft_dtype(tmp_path / "missing")
