"""The benchmark report: `out/bench/report.md` (a table) and `out/bench/ratios.png` (a chart).

Pure functions over parsed RESULT lines, so they can be tested without running a benchmark:
`parse_result` / `parse_skip` read a script's output, `render_markdown` and `render_chart` write
the report, `machine_info` describes where it ran. Every target is a floor (higher is better):
a benchmark passes when value / target >= 1.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
from matplotlib.figure import Figure  # after the backend is chosen

DPI = 100
CHART_WIDTH_IN = 9.0


@dataclass(frozen=True)
class Row:
    name: str
    value: float
    target: float
    unit: str

    @property
    def ratio(self) -> float:
        return self.value / self.target

    @property
    def passed(self) -> bool:
        return self.ratio >= 1.0


def parse_result(line: str) -> dict[str, str]:
    """`RESULT name=x value=1 target=2 unit=u` -> {"name": "x", "value": "1", ...}."""
    return dict(field.split("=", 1) for field in line.split()[1:])


def to_row(fields: Mapping[str, str]) -> Row:
    return Row(fields["name"], float(fields["value"]), float(fields["target"]), fields["unit"])


def parse_skip(lines: Iterable[str]) -> str | None:
    """The reason of a script's `SKIP: <why>` line, if it printed one."""
    for line in lines:
        if line.startswith("SKIP"):
            return line.partition(":")[2].strip() or "skipped"
    return None


def machine_info() -> dict[str, Any]:
    """Date, CPU count and model, and the GPUs torch sees (if torch is installed)."""
    cpu_model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu_model = line.partition(":")[2].strip()
                break
    except OSError:
        pass
    gpus: list[str] = []
    try:
        import torch

        if torch.cuda.is_available():
            gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    except ImportError:
        pass
    return {
        "date": time.strftime("%Y-%m-%d %H:%M %Z"),
        "cpus": os.cpu_count(),
        "cpu_model": cpu_model,
        "gpus": gpus,
    }


def _cell(text: object) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _number(x: float) -> str:
    return f"{x:g}"


def render_markdown(
    rows: Sequence[Row],
    skipped: Mapping[str, str],
    machine: Mapping[str, Any],
    failed: Sequence[str] = (),
) -> str:
    """The report: one table row per benchmark (measured, skipped with its reason, or failed)."""
    cpu = f"{machine.get('cpus')} CPUs"
    if machine.get("cpu_model"):
        cpu += f" ({machine['cpu_model']})"
    gpus = machine.get("gpus") or []
    gpu = ", ".join(gpus) if gpus else "none"
    passed = sum(r.passed for r in rows)
    lines = [
        "# Benchmark report",
        "",
        f"- date: {machine.get('date', '')}",
        f"- machine: {cpu}; GPU: {gpu}",
        f"- {passed} of {len(rows)} measured pass; {len(skipped)} skipped; {len(failed)} failed",
        "",
        "| benchmark | value | target | unit | value/target | result |",
        "|---|---:|---:|---|---:|---|",
    ]
    for r in rows:
        result = "pass" if r.passed else "FAIL"
        lines.append(
            f"| {_cell(r.name)} | {_number(r.value)} | {_number(r.target)} | {_cell(r.unit)} "
            f"| {r.ratio:.3f} | {result} |"
        )
    for name, why in skipped.items():
        lines.append(f"| {_cell(name)} | | | | | skipped: {_cell(why)} |")
    for name in failed:
        lines.append(f"| {_cell(name)} | | | | | error (no RESULT) |")
    return "\n".join(lines) + "\n"


def chart_size(n_rows: int) -> tuple[float, float]:
    """The chart's (width, height) in inches for n_rows bars; DPI pixels per inch."""
    return CHART_WIDTH_IN, 1.2 + 0.55 * max(n_rows, 1)


def render_chart(rows: Sequence[Row], path: Path) -> None:
    """A horizontal bar per benchmark of value / target, with a line at 1.0 (the target)."""
    fig = Figure(figsize=chart_size(len(rows)), dpi=DPI, layout="constrained")
    ax = fig.add_subplot()
    if not rows:
        ax.text(0.5, 0.5, "no results", ha="center", va="center", transform=ax.transAxes)
        ax.set_axis_off()
    else:
        ratios = [r.ratio for r in rows]
        y = range(len(rows))
        colors = ["tab:green" if r.passed else "tab:red" for r in rows]
        ax.barh(y, ratios, color=colors, height=0.6, zorder=2)
        ax.set_yticks(list(y), [r.name for r in rows], fontsize=10)
        ax.invert_yaxis()  # first benchmark on top, as in the table
        ax.axvline(1.0, color="black", linestyle="--", linewidth=1, zorder=1)
        right = max(1.0, *ratios) * 1.35
        ax.set_xlim(0, right)
        for i, r in enumerate(rows):
            label = f"{r.ratio:.2f}  ({_number(r.value)} / {_number(r.target)} {r.unit})"
            ax.text(
                r.ratio + right * 0.01,
                i,
                label,
                va="center",
                fontsize=9,
                zorder=3,
                bbox={"facecolor": "white", "edgecolor": "none", "pad": 1},
            )
        ax.set_xlabel("value / target  (>= 1 passes)")
    ax.set_title("Benchmarks: value / target")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", dpi=DPI)


def write_report(
    out: Path,
    rows: Sequence[Row],
    skipped: Mapping[str, str],
    failed: Sequence[str] = (),
    machine: Mapping[str, Any] | None = None,
) -> tuple[Path, Path]:
    """Write report.md and ratios.png under `out`; returns their paths."""
    out.mkdir(parents=True, exist_ok=True)
    md, png = out / "report.md", out / "ratios.png"
    md.write_text(render_markdown(rows, skipped, machine or machine_info(), failed))
    render_chart(rows, png)
    return md, png
