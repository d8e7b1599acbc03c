"""Accept length of a draft trained on our data, served by SGLang beside its target.

    make bench BENCH=draft_accept        # ~28 min on 2 cores: one capture, five rounds

The proof by serving's pipeline (tools/draft_proof.py: the trained tiny target, a capture job
through `ray job submit`, the speculators export, speculators' CPU training, hsx draft-convert,
hsx draft-bench in float32), measured rather than checked. The job runs once; each round
trains a draft with its own seed (0..ROUNDS-1: the draft's initialization and batch order)
and serves it, the random draft of the same seed (the baseline: the same architecture, no
training) and the trained one on aux layers shifted by one, against one plain run of the
target on the same held-out prompts. Printed per round: each draft's accept length and
per-position acceptance; then the medians and spreads. The value is the median trained accept
length, the target the median random one plus the proof's margin.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
from pathlib import Path

from tools.draft_proof import MARGIN, REPO, STEPS, TARGET, capture, train_and_serve
from tools.tiny_models import ensure_models

ROUNDS = 5


def main() -> int:
    target = ensure_models(REPO / ".cache/models", [TARGET])[TARGET].resolve()
    lengths: dict[str, list[float]] = {"trained": [], "random": [], "shifted": []}
    with tempfile.TemporaryDirectory(prefix="hsx-draft-accept-") as tmp:
        captured = capture(Path(tmp), target)
        for seed in range(ROUNDS):
            reports = train_and_serve(Path(tmp), target, captured, STEPS, seed)["reports"]
            for name, report in reports.items():
                lengths[name].append(report["accept_length"])
                positions = " ".join(f"{rate:.3f}" for rate in report["per_position"])
                print(
                    f"round {seed}: {name}: accept length {report['accept_length']:.3f}, "
                    f"per position {positions}",
                    flush=True,
                )
    for name, values in lengths.items():
        print(
            f"{name}: median {statistics.median(values):.3f} "
            f"(spread {min(values):.3f}..{max(values):.3f})"
        )
    drops = [t - s for t, s in zip(lengths["trained"], lengths["shifted"], strict=True)]
    print(f"shifted by one layer costs: {' '.join(f'{d:.3f}' for d in drops)}")
    value = statistics.median(lengths["trained"])
    target_value = statistics.median(lengths["random"]) + MARGIN
    print(
        f"RESULT name=draft_accept value={value:.3f} target={target_value:.3f} "
        "unit=tokens_per_verify_step"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
