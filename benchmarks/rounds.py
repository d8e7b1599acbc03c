"""Alternating rounds for ratio benchmarks: the measured path against its baseline.

Baseline and measured path run in rounds within one process, the order flipped each round
(ABBA...); each round gives one ratio, and the value is the median of those ratios, printed
with their spread.

    ratios = alternate(baseline=lambda: nbytes / raw(), measured=lambda: nbytes / ours(), rounds=5)
    ratios.show("GB/s")
    print(ratios.result_line("reader_vs_raw_read", target=0.8))

On a VM that reports free pages to its host (virtio-balloon), memory freed seconds earlier costs
~20x to touch again: `alternate` faults in the memory the next call takes (`fault_in_bytes`),
untimed, and prints how to turn reporting off where it is on.

Why, and the measurements: docs/benchmarks.md.
"""

from __future__ import annotations

import functools
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

MIN_ROUNDS = 5


@dataclass(frozen=True)
class Rounds:
    """Per-round rates of both sides (higher is better), in the order they were measured."""

    baseline: list[float]
    measured: list[float]

    @property
    def ratios(self) -> list[float]:
        return [m / b for m, b in zip(self.measured, self.baseline, strict=True)]

    @property
    def median(self) -> float:
        return statistics.median(self.ratios)

    @property
    def spread(self) -> float:
        """(max - min) / median of the per-round ratios."""
        ratios = self.ratios
        return (max(ratios) - min(ratios)) / self.median

    def show(self, unit: str, baseline: str = "baseline", measured: str = "measured") -> None:
        width = max(len(baseline), len(measured), len("ratio"))
        for name, values in ((baseline, self.baseline), (measured, self.measured)):
            rounds = " ".join(f"{v:.3g}" for v in values)
            print(f"  {name:{width}s} {statistics.median(values):8.3g} {unit}  (rounds: {rounds})")
        rounds = " ".join(f"{r:.3f}" for r in self.ratios)
        print(f"  {'ratio':{width}s} {self.median:8.3f} median  (rounds: {rounds})")
        print(
            f"  spread {min(self.ratios):.3f}..{max(self.ratios):.3f} "
            f"({self.spread:.1%} of the median) over {len(self.ratios)} rounds"
        )

    def result_line(self, name: str, target: float) -> str:
        return f"RESULT name={name} value={self.median:.3f} target={target} unit=ratio"


def alternate(
    baseline: Callable[[], float],
    measured: Callable[[], float],
    rounds: int = MIN_ROUNDS,
    between: Callable[[], None] | None = None,
    fault_in_bytes: int = 0,
) -> Rounds:
    """Run both sides `rounds` times, alternating which goes first; each call returns a rate.

    Before every call, untimed as far as the callables are concerned: `between` (e.g. dropping
    a file's pages before a cold read), then `fault_in(fault_in_bytes)`.
    """
    if rounds < MIN_ROUNDS:
        raise ValueError(f"a ratio needs at least {MIN_ROUNDS} rounds, got {rounds}")
    warn_if_free_pages_are_reported()
    base: list[float] = []
    ours: list[float] = []
    for r in range(rounds):
        order = ((base, baseline), (ours, measured))
        for rates, run in order if r % 2 == 0 else reversed(order):
            if between is not None:
                between()
            fault_in(fault_in_bytes)
            rates.append(run())
    return Rounds(base, ours)


REPORTING_ORDER = Path("/sys/module/page_reporting/parameters/page_reporting_order")
NO_REPORTING = 11  # above the largest buddy order (10): no free block qualifies


@functools.cache  # once per run
def warn_if_free_pages_are_reported() -> None:
    """Say so where this VM hands freed memory back to its host (see the module docstring)."""
    try:
        order = int(REPORTING_ORDER.read_text())
    except (OSError, ValueError):
        return  # no free page reporting in this kernel
    if order < NO_REPORTING:
        print(
            f"NOTE: this VM reports free pages to its host (page_reporting_order {order}): "
            "memory-bound rates vary up to 2x between runs. For steady figures turn it off "
            f"for the run: echo {NO_REPORTING} | sudo tee {REPORTING_ORDER} "
            f"(restore: echo {order} | sudo tee {REPORTING_ORDER})",
            flush=True,
        )


def fault_in(nbytes: int) -> None:
    """Touch `nbytes` of fresh memory and free it, so that the next `nbytes` the process or the
    page cache takes are backed by the host (see the module docstring)."""
    if nbytes > 0:
        np.ones(nbytes, np.uint8)
