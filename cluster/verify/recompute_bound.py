"""How far `verify --recompute` lets stored rows be from a fresh recompute: a multiple of the
batch noise measured across all the samples checked, not of one sample's alone.

A sample's own noise (its alone vs batched recompute) is a draw, not the model's noise: when
both recomputes happen to prefill it alike (a prompt that fits one chunk, sent first) it is 0
while the job's rows, prefilled in other batches, differ by the model's usual rounding. So each
sample's bound is `NOISE_MULTIPLE` x max(its own noise, the checked samples' noise at
`POOLED_QUANTILE`, the dtype's floor), per hidden array. The measurements behind the constants:
docs/design/verify.md.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from hsx_store.fp8 import FP8_DTYPE

# Measured in bf16 on CPU, `--chunked-prefill-size 16`, 8 samples (docs/design/verify.md): on
# llama-tiny noise 0..1.1% and the job's rows <= 1.16% from the nearer recompute (2.9 x the noise
# at most where it was small); on tests/helpers/noisy_model.py (a real model's noise) noise
# 0..7.1% final, 0..2.7% aux, the correct rows <= 6.2% final, 2.4% aux, pooled noise 6.1% / 2.4%,
# so bounds of 24% / 10%. Wrong rows: 50% (final scaled by 1.5), 121% (another aux layer),
# 150%..200% (shifted by a token, another sample's): still 2 x the bound and more.
NOISE_MULTIPLE = 4.0
# Where every checked sample's recomputes agreed bit for bit (a batch-invariant model), the floor
# keeps the bound from demanding bit equality of the job's rows: bf16 1% (~2.5 roundings of the
# 8-bit significand); float32 1e-5 (16 x its noise of <= 6.1e-7, 10 x float32 serving's distance
# from HF float32); fp8_e4m3 stores hold bf16 rows rounded to e4m3, whose worst row is 3.1% from
# the bf16 one (benchmarks/fp8_fidelity.py), so 2%.
NOISE_FLOOR = {"bfloat16": 1e-2, "float32": 1e-5, FP8_DTYPE: 2e-2}
# The upper quartile, not the largest: one sample whose two recomputes differ far more than the
# rest (an MoE routing near-tie flipped between them) widens its own bound, not every sample's.
POOLED_QUANTILE = 0.75


def relative(x: float) -> str:
    """A relative figure: percent, or scientific below 0.1% (float32 bounds are ~1e-5)."""
    return f"{x:.3%}" if not x < 1e-3 else f"{x:.2e}"


def pooled_noise(noises: Iterable[float]) -> float:
    """The checked samples' alone-vs-batched noise at POOLED_QUANTILE; NaN ones (a recompute
    with NaN rows, which fails its own sample) left out; 0 when none is left."""
    finite = [n for n in noises if math.isfinite(n)]
    return float(np.quantile(finite, POOLED_QUANTILE)) if finite else 0.0


@dataclass(frozen=True)
class Bound:
    """One sample's bound for one hidden array."""

    own: float  # the sample's alone-vs-batched noise
    pooled: float  # pooled_noise of every checked sample's, this array's
    samples: int  # how many samples' noise was pooled
    floor: float

    @property
    def value(self) -> float:
        """NaN (which no distance is within) when the sample's own recomputes hold NaN."""
        if math.isnan(self.own):
            return math.nan
        return NOISE_MULTIPLE * max(self.own, self.pooled, self.floor)

    def admits(self, distance: float) -> bool:
        return distance <= self.value  # NaN is admitted by nothing

    def explain(self) -> str:
        return (
            f"alone vs batched recompute {relative(self.own)}, {relative(self.pooled)} over the "
            f"{self.samples} samples checked (upper quartile); bound {relative(self.value)} = "
            f"{NOISE_MULTIPLE:g} x max(those, floor {self.floor:.0e})"
        )
