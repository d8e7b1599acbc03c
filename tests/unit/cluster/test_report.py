"""The driver's progress line: rates over working time, shards of earlier runs counted as done."""

from __future__ import annotations

import re

from cluster.generation_feed import _count
from cluster.generation_stats import GenerationStats, covered_seconds
from cluster.report import ProgressMeter, build_report, format_report
from tests.helpers.synthetic import new_store, write_shard


def shard(samples: int, tokens: int, failed: int = 0) -> dict:
    return {
        "samples": samples,
        "tokens": tokens,
        "bytes_written": tokens * 4_000_000,
        "failed": {f"s{i}": "why" for i in range(failed)},
    }


def test_progress_rates_start_with_the_first_written_sample() -> None:
    meter = ProgressMeter(
        total_samples=20, total_tokens=2000, done_samples=4, done_tokens=400, started=0.0
    )
    startup = meter.line([], 0, {"starting": 2}, now=60.0)
    assert "samples 4/20" in startup and "0 tok/s" in startup and "ETA ?" in startup
    assert "workers: 2 starting" in startup
    meter.line([], 1, {"working": 2}, now=100.0)  # the first sample: working time starts
    line = meter.line([shard(4, 400, failed=1)], 3, {"working": 1, "idle": 1}, now=110.0)
    # 4 earlier + 4 completed + 3 in flight; 400 tokens in 10 s of work; 1200 tokens left.
    assert "samples 11/20 (1 failed)" in line and "40 tok/s" in line
    assert "0.160 GB/s" in line and "ETA 0:00:30" in line and "elapsed 0:01:50" in line
    assert "workers: 1 idle, 1 working" in line and " 55%" in line


def test_the_report_counts_failed_uncommitted_and_rejected_samples(tmp_path) -> None:
    store = new_store(tmp_path / "s.zarr")  # 3 shards; one plan-time reject
    write_shard(store, 0)
    summary = {"worker": "w1", "tokens": 32, "seconds": 2.0, "server_restarts": 1}
    write_shard(store, 1, failed={5: "token ids differ from the plan"}, summary=summary)
    report = build_report(
        store,
        {
            "store_url": "s.zarr",
            "seconds": 4.0,
            "given_up": {"2": ["w2: worker died", "w3: lease expired"]},
        },
    )

    assert not report["ok"]
    assert report["samples"] == {
        "planned": 11,
        "written": 7,
        "failed": 1,
        "not_committed": 3,
        "rejected_at_plan": 1,
    }
    assert report["failed_samples"] == [
        {"sample_id": "s5-é", "reason": "token ids differ from the plan"}
    ]
    assert report["shards"]["not_committed"] == [2]
    assert report["workers"]["w1"]["server_restarts"] == 1
    text = format_report(report)
    assert "INCOMPLETE OR FAILED SAMPLES" in text and "failed s5-é: token ids differ" in text
    assert "rejected bad: too long" in text and "shard 2 given up: w2: worker died" in text


def part(started_at: float, seconds: float, tokens: int) -> dict:
    """A generated part's record, as a worker writes it (actors/generator.py), one response."""
    turn = {"output_ids": [7] * tokens, "finish_reason": "stop"}
    return {"samples": [{"turns": [turn]}], "started_at": started_at, "seconds": seconds}


def test_generated_tok_s_is_over_the_wall_time_some_part_was_generating(tmp_path) -> None:
    """Parts generated at once count their wall time once: a worker runs the next part's
    requests while the last ones of the part before finish, and workers run side by side."""
    stats = GenerationStats()
    t0 = 1_700_000_000.0
    records = [
        part(t0 - 3600, 100, 300),  # kept from an earlier run: the hour between is no generation
        part(t0, 90, 500),  # worker 1's parts, overlapping
        part(t0 + 80, 90, 500),
        part(t0 + 10, 60, 508),  # worker 2, at the same time
        part(t0 + 200, 10, 500),  # after a pause: 170 s to 200 s generated nothing
        {"samples": [{"sample_id": "x", "error": "given up"}]},  # a given-up part: no times
    ]
    for record in records:
        _count(stats, record)
    # 100 s + [0, 170] + [200, 210]: 280 s; summing each part's time would say 350 s.
    assert covered_seconds(stats.generate_spans) == 280
    generation = stats.to_json()
    assert generation["generated_tokens"] == 2308
    assert generation["generated_tokens_per_s"] == round(2308 / 280, 1)  # not 2308 / 350
    store = new_store(tmp_path / "s.zarr")
    text = format_report(build_report(store, {"planning": {"generation": generation}}))
    assert re.search(r"^generated tok/s +8\.2$", text, re.MULTILINE), text


def test_covered_seconds_counts_each_instant_once() -> None:
    assert covered_seconds([]) == 0
    assert covered_seconds([(5, 9), (0, 2), (1, 3), (2.5, 4), (6, 7)]) == 8  # [0, 4] + [5, 9]
    assert covered_seconds([(0, 10), (2, 3)]) == 10  # one inside another
