"""Reading a verify report in tests."""

from __future__ import annotations

from pathlib import Path

from cluster.verify import verify as verify_command
from hsx_store.integrity import CHECKS, VerifyReport


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
