"""examples/train_while_extracting.py run as a user runs it: in the released trainers' venv, in
a process of its own."""

from __future__ import annotations

import subprocess
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_while_extracting.py"


def train(python: Path, url: Path, out: Path) -> subprocess.Popen[bytes]:
    """The example trainer in a process of its own, a step per sample and a checkpoint per
    step; its output goes to OUT/log-<n>.txt, n counting its runs."""
    out.mkdir(exist_ok=True)
    log = out / f"log-{len(list(out.glob('log-*.txt'))) + 1}.txt"
    args = ["--samples-per-step", "1", "--save-every", "1", "--poll-s", "0.2", "--wait-s", "300"]
    with log.open("wb") as sink:
        return subprocess.Popen(
            [str(python), str(EXAMPLE), "--store", str(url), "--out", str(out), *args],
            stdout=sink,
            stderr=subprocess.STDOUT,
        )
