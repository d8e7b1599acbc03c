"""Reading a verify report in tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from cluster.verify import verify as verify_command
from hsx_store.integrity_report import CHECKS, VerifyReport


def verify(path: Path, **kw) -> VerifyReport:
    report = verify_command(path, say=lambda _: None, **kw)
    print(report.format())
    return report


def errors(report: VerifyReport, check: str | None = None) -> list[str]:
    return [
        f.message
        for f in report.findings
        if f.level == "error" and (check is None or f.check == check)
    ]


def check_lines(report: VerifyReport) -> dict[str, str]:
    """check name -> OK / FAIL / SKIP, from the formatted report."""
    lines = [line.split() for line in report.format().splitlines()[1 : 1 + len(CHECKS)]]
    return {words[1]: words[0] for words in lines}


def assert_status_is_report(status: dict[str, Any], report: dict[str, Any]) -> None:
    """`python -m cluster status` of a complete job says what the driver's report says."""
    assert status["state"] == "complete" and status["eta_s"] is None
    shards = report["shards"]
    assert status["shards"] == {"planned": shards["total"], "committed": shards["committed"]}
    for key in ("planned", "written", "failed", "rejected_at_plan"):
        assert status["samples"][key] == report["samples"][key], key
    assert status["tokens"] == {k: report["tokens"][k] for k in ("planned", "committed")}
