"""`python -m cluster status`: what a store says about its job, counted from the store alone,
while the job runs, when it is complete (equal to the driver's report) and after a run that
ended short."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from cluster.__main__ import main
from cluster.cli import positive_seconds
from cluster.report import build_report
from cluster.status import RECENT_S, job_status
from hsx_store.format import Store
from tests.helpers.reports import assert_status_is_report
from tests.helpers.synthetic import new_store, plan, write_shard

NAMES = plan()[0]


def tokens(store: Store, *shards: int) -> int:
    return sum(store.shards[k].token_end - store.shards[k].token_begin for k in shards)


def test_status_while_running_counts_rates_and_eta_from_the_commits(tmp_path: Path) -> None:
    store = new_store(tmp_path / "s.zarr")
    now = time.time()
    write_shard(store, 0, summary={"finished_at": now - 400, "seconds": 100})
    failed = {9: "token ids differ from the plan"}
    write_shard(store, 2, failed=failed, summary={"finished_at": now - 60, "seconds": 30})

    status = job_status(str(tmp_path / "s.zarr"), now=now)
    assert status["state"] == "running" and status["planning"] == "done"
    assert status["shards"] == {"planned": 3, "committed": 2}
    visible = store.shards[0].sample_end - store.shards[0].sample_begin + 3 - 1
    assert status["samples"] == {
        "planned": 11,
        "written": visible,
        "failed": 1,
        "rejected_at_plan": 1,
    }
    assert status["tokens"] == {"planned": tokens(store, 0, 1, 2), "committed": tokens(store, 0, 2)}
    recent = tokens(store, 2) / RECENT_S  # only shard 2 committed in the last 5 minutes
    assert status["tokens_per_s"]["last_5_min"] == pytest.approx(recent, abs=0.1)
    # since shard 0 was started (500 s ago) until the last commit (60 s ago)
    assert status["tokens_per_s"]["since_start"] == pytest.approx(
        tokens(store, 0, 2) / 440, abs=0.1
    )
    assert status["eta_s"] == pytest.approx(tokens(store, 1) / recent, abs=0.5)
    assert status["failed"] == [{"sample_id": NAMES[9], "reason": failed[9]}]
    assert status["last_commit_s_ago"] == 60.0


def test_status_of_a_complete_job_equals_its_report_and_a_short_run_says_it_ended(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    url = str(tmp_path / "s.zarr")
    store = new_store(url)
    write_shard(store, 0, summary={"finished_at": time.time() - 5, "seconds": 1})
    # A run that ended with shard 2 failed and 1 never committed: its report is newer than
    # its last commit.
    store.group.attrs["report"] = build_report(store, {"seconds": 6.0})
    status = job_status(url)
    assert status["state"] == "ended" and status["last_run"]["ok"] is False
    assert main(["status", "--store", url]) == 1
    assert "ended (planning done)" in capsys.readouterr().out

    for k in (1, 2):
        write_shard(store, k, summary={"finished_at": time.time(), "seconds": 1})
    report = build_report(store, {"seconds": 1.0})
    store.group.attrs["report"] = report
    assert_status_is_report(job_status(url), report)
    assert main(["status", "--store", url, "--follow"]) == 0  # complete: it does not wait
    out = capsys.readouterr().out
    assert "complete (planning done)" in out and "11 / 11 written, 0 failed" in out


def test_status_of_no_store_exits_2_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    assert main(["status", "--store", str(tmp_path / "nothing.zarr")]) == 2
    assert f"no store at {tmp_path / 'nothing.zarr'}" in capsys.readouterr().err


@pytest.mark.parametrize(
    "node,text",
    [
        ("", "{not json"),
        ("", '{"zarr_format": 3, "node_type": "group", "attributes": 5}'),
        ("shard_summary", ""),
    ],
)
def test_status_of_a_store_with_a_damaged_zarr_json_exits_2_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture, node: str, text: str
) -> None:
    url = str(tmp_path / "s.zarr")
    new_store(url)
    assert main(["status", "--store", url]) == 1  # intact: read, and not complete
    capsys.readouterr()
    (Path(url) / node / "zarr.json").write_text(text)
    assert main(["status", "--store", url]) == 2
    err = capsys.readouterr().err
    assert f"{Path(url, node)}/zarr.json is damaged" in err and "Traceback" not in err


@pytest.mark.parametrize("interval", ["-1", "0", "nan", "soon"])
def test_a_follow_interval_that_is_not_positive_seconds_exits_2_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture, interval: str
) -> None:
    url = str(tmp_path / "s.zarr")
    new_store(url)
    with pytest.raises(SystemExit) as exit:
        main(["status", "--store", url, "--follow", "--interval", interval])
    assert exit.value.code == 2
    assert "argument --interval: expected seconds" in capsys.readouterr().err
    assert positive_seconds("0.5") == 0.5
