"""`make bench [BENCH=name]`: run every benchmark script (or one) and tabulate their RESULT lines.

Each `benchmarks/<name>.py` measures its own baseline in the same run and prints, as its last
line, `RESULT name=<name> value=<number> target=<number> unit=<unit>`. A script that cannot run
here (for example one that needs CUDA) prints `SKIP: <why>` and no RESULT.

Besides the table on stdout, writes out/bench/report.md (the table with value/target, pass/fail,
the skipped ones and the machine) and out/bench/ratios.png (value/target per benchmark); see
benchmarks/report.py.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from benchmarks.report import parse_result, parse_skip, to_row, write_report

HERE = Path(__file__).parent
OUT = HERE.parent / "out" / "bench"
# Helpers, and a measurement with no target (s3_request_rate): not benchmarks.
NOT_BENCHMARKS = {"__init__", "run", "report", "rounds", "s3_request_rate"}

__all__ = ["main", "parse_result"]


def main() -> int:
    names = sys.argv[1:] or sorted(
        p.stem for p in HERE.glob("*.py") if p.stem not in NOT_BENCHMARKS
    )
    rows, skipped, failed = [], {}, []
    for name in names:
        print(f"== {name}", flush=True)
        proc = subprocess.run(
            [sys.executable, "-m", f"benchmarks.{name}"], capture_output=True, text=True
        )
        sys.stdout.write(proc.stdout)
        lines = proc.stdout.strip().splitlines()
        skip = parse_skip(lines)
        if proc.returncode != 0:
            sys.stdout.write(proc.stderr[-3000:])
            failed.append(name)
        elif lines and lines[-1].startswith("RESULT "):
            rows.append(to_row(parse_result(lines[-1])))
        elif skip is not None:
            skipped[name] = skip
        else:
            failed.append(name)
            print(f"{name}: no RESULT line")
    print("\n| benchmark | value | target | unit |\n|---|---|---|---|")
    for row in rows:
        print(f"| {row.name} | {row.value:g} | {row.target:g} | {row.unit} |")
    for name, why in skipped.items():
        print(f"| {name} | skipped: {why} | | |")
    if failed:
        print(f"failed: {', '.join(failed)}")
    md, png = write_report(OUT, rows, skipped, failed)
    print(f"report: {md.relative_to(HERE.parent)}, {png.relative_to(HERE.parent)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
