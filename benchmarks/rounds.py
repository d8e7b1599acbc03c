"""Alternating rounds for ratio benchmarks: the measured path against its baseline.

Every ratio benchmark runs its baseline and its measured path in rounds within one process, the
order flipped each round (ABBA...) so drift on a shared machine hits both sides alike; each round
gives one ratio (measured rate / baseline rate), and the benchmark's value is the median of those
ratios, printed with their spread. A best-of-N over each side separately would pair a lucky
baseline with a lucky measurement from different moments, which is what made the earlier ratios
move more between runs than any change did.

    ratios = alternate(baseline=lambda: nbytes / raw(), measured=lambda: nbytes / ours(), rounds=5)
    ratios.show("GB/s")
    print(ratios.result_line("reader_vs_raw_read", target=0.8))
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass

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
) -> Rounds:
    """Run both sides `rounds` times, alternating which goes first; each call returns a rate.

    `between` runs before every call (e.g. dropping a file's pages before a cold read), untimed
    as far as the callables are concerned.
    """
    if rounds < MIN_ROUNDS:
        raise ValueError(f"a ratio needs at least {MIN_ROUNDS} rounds, got {rounds}")
    base: list[float] = []
    ours: list[float] = []
    for r in range(rounds):
        order = ((base, baseline), (ours, measured))
        for rates, run in order if r % 2 == 0 else reversed(order):
            if between is not None:
                between()
            rates.append(run())
    return Rounds(base, ours)
