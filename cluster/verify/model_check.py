"""What the checks that need the model (recompute, logprobs) share: which samples they check,
whether the model is the store's, and how a failure to run at all is reported."""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import numpy as np

from cluster.verify.server import VerifyServer
from hsx_store.format import STATUS_WRITTEN, Store
from hsx_store.integrity_report import VerifyReport
from hsx_store.model_identity import model_mismatches


def checked_samples(store: Store, count: int, seed: int) -> list[int]:
    """`count` seeded random written samples of committed shards, ascending."""
    status = np.asarray(store.group["sample_status"][:])
    marks = store.committed()
    candidates = [
        i
        for sh in store.shards
        if marks[sh.index]
        for i in range(sh.sample_begin, sh.sample_end)
        if status[i] == STATUS_WRITTEN
    ]
    rng = np.random.default_rng(seed)
    picked = rng.choice(candidates, size=min(count, len(candidates)), replace=False)
    return sorted(int(i) for i in picked)


class ModelCheck:
    """One check on the model's server. `check` does what every model check does first (which
    samples, is it the store's model) and reports a failure to run at all; subclasses say what
    else skips or refuses it, and do the work in `run_on`."""

    name: ClassVar[str]  # the check's name in the report, and its flag (--recompute)
    cannot: ClassVar[str]  # how "it could not run at all" reads: "cannot recompute"
    listing: ClassVar[str]  # the title of its per-sample lines in the report

    def __init__(
        self,
        store: Store,
        report: VerifyReport,
        server: VerifyServer | None,
        say: Callable[[str], None],
    ) -> None:
        self.store, self.report, self.server, self.say = store, report, server, say

    @classmethod
    def run_check(
        cls,
        store: Store,
        report: VerifyReport,
        *,
        server: VerifyServer | None,
        count: int,
        seed: int,
        say: Callable[[str], None],
    ) -> str | None:
        """The check on `count` samples, as hsx_store.integrity.verify_store runs a check (with
        the store and its report, the rest bound): a skip reason or None."""
        return cls(store, report, server, say).check(count, seed)

    def check(self, count: int, seed: int) -> str | None:
        if count <= 0 or self.server is None:
            return f"no --model / --{self.name}"
        if self.report.checks.get("commits") != "ran":
            return "the commit check did not run"
        samples = checked_samples(self.store, count, seed)
        if not samples:
            return "no written sample to check"
        if reason := self.skip_reason():
            return reason
        problems = [
            f"{problem}: not the model that made the store"
            for problem in model_mismatches(self.server.model_path, self.store.manifest)
        ] + self.model_problems()
        for problem in problems:
            self.report.error(self.name, problem)
        if problems:
            return None
        self.say(f"{self.name}: samples {samples} (seed {seed})")
        try:
            self.run_on(samples)
        except Exception as exc:  # no server, failed calibration, no lm_head, ...
            self.report.error(self.name, f"{self.cannot}: {type(exc).__name__}: {exc}")
        return None

    def tell(self, line: str) -> None:
        """One checked sample's line: said now, and listed in the report."""
        self.say(f"{self.name} {line}")
        self.report.list_sample(self.listing, line)

    def label(self, i: int) -> str:
        return f"{i} ({self.store.group['sample_id'][i]})"

    def input_ids(self, i: int) -> np.ndarray:
        return np.asarray(self.store.group["input_ids"][self.store.sample_rows(i)]).astype(np.int64)

    def skip_reason(self) -> str | None:
        """Why this store is outside what the check can judge; None: it can."""
        return None

    def model_problems(self) -> list[str]:
        """What, beyond being another checkpoint, makes the model unfit for this check."""
        return []

    def run_on(self, samples: list[int]) -> None:
        raise NotImplementedError
