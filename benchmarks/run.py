"""`make bench [BENCH=name]`: run every benchmark script (or one) and tabulate their RESULT lines.

Each `benchmarks/<name>.py` measures its own baseline in the same run and prints, as its last
line, `RESULT name=<name> value=<number> target=<number> unit=<unit>`. A script that cannot run
here (for example one that needs CUDA) prints `SKIP: <why>` and no RESULT.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent
NOT_BENCHMARKS = {"__init__", "run"}


def parse_result(line: str) -> dict[str, str]:
    return dict(field.split("=", 1) for field in line.split()[1:])


def main() -> int:
    names = sys.argv[1:] or sorted(
        p.stem for p in HERE.glob("*.py") if p.stem not in NOT_BENCHMARKS
    )
    rows, failed = [], []
    for name in names:
        print(f"== {name}", flush=True)
        proc = subprocess.run(
            [sys.executable, "-m", f"benchmarks.{name}"], capture_output=True, text=True
        )
        sys.stdout.write(proc.stdout)
        lines = proc.stdout.strip().splitlines()
        if proc.returncode != 0:
            sys.stdout.write(proc.stderr[-3000:])
            failed.append(name)
        elif lines and lines[-1].startswith("RESULT "):
            rows.append(parse_result(lines[-1]))
        elif not any(line.startswith("SKIP") for line in lines):
            failed.append(name)
            print(f"{name}: no RESULT line")
    print("\n| benchmark | value | target | unit |\n|---|---|---|---|")
    for row in rows:
        print(f"| {row['name']} | {row['value']} | {row['target']} | {row['unit']} |")
    if failed:
        print(f"failed: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
