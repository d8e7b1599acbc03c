"""What `python -m cluster verify` reports, and how it reads: each check OK / FAIL / SKIP by
name, the findings (each naming the shard, sample or array concerned), the counts, per-sample
listings, and the exit status. The store's checks (hsx_store/integrity.py) and the model checks
(cluster/verify/) fill it in.

Exit status (`VerifyReport.exit_code`): 0 no errors, 1 errors, 2 the store cannot be read.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

CHECKS = (
    "manifest",
    "arrays",
    "layout",
    "commits",
    "plan",
    "images",
    "chunks",
    "values",
    "recompute",
    "logprobs",
)


@dataclass
class Finding:
    level: Literal["error", "warning"]
    check: str
    message: str  # names the shard, sample or array


@dataclass
class VerifyReport:
    findings: list[Finding] = field(default_factory=list)
    checked: dict[str, Any] = field(default_factory=dict)  # counts, and info lists
    url: str = ""
    checks: dict[str, str] = field(default_factory=dict)  # name -> "ran" or "skipped: why"
    unreadable: bool = False  # the store could not be opened: nothing past "manifest" ran
    # title -> one line per sample, in the order added: what the model checks found per sample
    # (their results are theirs to describe; this layer only prints the lines)
    listings: dict[str, list[str]] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not any(f.level == "error" for f in self.findings)

    @property
    def exit_code(self) -> int:
        return 2 if self.unreadable else 0 if self.ok else 1

    def error(self, check: str, message: str) -> None:
        self.findings.append(Finding("error", check, message))

    def warning(self, check: str, message: str) -> None:
        self.findings.append(Finding("warning", check, message))

    def list_sample(self, title: str, line: str) -> None:
        self.listings.setdefault(title, []).append(line)

    def format(self) -> str:
        lines = [f"store verification: {self.url}"]
        for name in CHECKS:
            lines.append(f"  {self._status(name):<5} {name:<10} {self._detail(name)}".rstrip())
        counts = {k: v for k, v in self.checked.items() if isinstance(v, int | float | str)}
        if counts:
            lines.append("checked: " + ", ".join(f"{k} {v}" for k, v in counts.items()))
        for f in self.findings:
            lines.append(f"  {f.level.upper()} [{f.check}] {f.message}")
        for title, key in (("failed samples", "failed"), ("rejected at plan", "rejected")):
            items = self.checked.get(key) or []
            if items:
                lines.append(f"{title} ({len(items)}):")
                lines += [f"  {r['sample_id']}: {r['reason']}" for r in items[:20]]
                if len(items) > 20:
                    lines.append(f"  ... and {len(items) - 20} more")
        for title, listed in self.listings.items():
            lines.append(f"{title} ({len(listed)}):")
            lines += [f"  {line}" for line in listed]
        errors = sum(f.level == "error" for f in self.findings)
        warnings = len(self.findings) - errors
        verdict = "UNREADABLE" if self.unreadable else "OK" if self.ok else "FAIL"
        lines.append(f"result: {verdict} ({errors} errors, {warnings} warnings)")
        return "\n".join(lines)

    def _detail(self, name: str) -> str:
        state = self.checks.get(name, "skipped: not run")
        if state.startswith("skipped"):
            return f"({state.removeprefix('skipped: ')})"
        levels = [f.level for f in self.findings if f.check == name]
        parts = [f"{levels.count(x)} {x}s" for x in ("error", "warning") if x in levels]
        return f"({', '.join(parts)})" if parts else ""

    def _status(self, name: str) -> str:
        state = self.checks.get(name, "skipped: not run")
        if state.startswith("skipped"):
            return "SKIP"
        failed = any(f.check == name and f.level == "error" for f in self.findings)
        return "FAIL" if failed else "OK"
