"""Accept length of a draft trained on our data, served by SGLang beside its target.

    make bench BENCH=draft_accept        # about as long as `make proof` (it is the same run)

The proof by serving's pipeline (tools/draft_proof.py: the trained tiny target, a generating
job, the speculators export, speculators' CPU training, hsx draft-convert, hsx draft-bench in
float32), measured rather than checked. The baseline is the random draft of the same
architecture and seed, served in the same run, on the same held-out prompts; the target is
it plus the proof's margin. Printed: each draft's accept length and per-position acceptance
(trained, random, trained but served on the aux layers shifted by one).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from tools.draft_proof import MARGIN, REPO, STEPS, TARGET, prove
from tools.tiny_models import ensure_models


def main() -> int:
    target = ensure_models(REPO / ".cache/models", [TARGET])[TARGET].resolve()
    with tempfile.TemporaryDirectory(prefix="hsx-draft-accept-") as out:
        results = prove(Path(out), target, STEPS, seed=0)
    reports = results["reports"]
    for name, report in reports.items():
        positions = " ".join(f"{rate:.3f}" for rate in report["per_position"])
        print(f"{name}: accept length {report['accept_length']:.3f}, per position {positions}")
    trained, random = reports["trained"]["accept_length"], reports["random"]["accept_length"]
    print(
        f"RESULT name=draft_accept value={trained:.3f} target={random + MARGIN:.3f} "
        "unit=tokens_per_verify_step"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
