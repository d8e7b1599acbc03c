"""verify --recompute's bound: each sample held to the noise of every sample checked, not its own
alone; still far below wrong rows; one outlier widens only its own bound."""

from __future__ import annotations

import math

import pytest

from cluster.verify.recompute_bound import NOISE_FLOOR, NOISE_MULTIPLE, Bound, pooled_noise

BF16 = NOISE_FLOOR["bfloat16"]

# Issue 33, defect 7 (SmolLM2-135M in bf16, `verify --recompute 4`): sample 26's own noise was 0,
# the other three's 3.0%..6.7% (the middle one's figure is not in the issue: 4.5% here), and its
# correct final rows were 4.819% from the nearer recompute.
SMOLLM2_NOISE = {3: 0.030, 11: 0.045, 19: 0.067, 26: 0.0}
SMOLLM2_DISTANCE = 0.04819


def bound(own: float, noises: dict[int, float], floor: float = BF16) -> Bound:
    return Bound(own, pooled_noise(noises.values()), len(noises), floor)


def test_a_sample_whose_own_noise_is_0_is_held_to_the_noise_of_all() -> None:
    got = bound(SMOLLM2_NOISE[26], SMOLLM2_NOISE)
    assert got.pooled == pytest.approx(0.045 + 0.25 * (0.067 - 0.045))  # upper quartile
    assert got.admits(SMOLLM2_DISTANCE)
    # The rule it replaces (the sample's own noise, or the floor): 4% fails the correct store.
    assert not Bound(SMOLLM2_NOISE[26], 0.0, 1, BF16).admits(SMOLLM2_DISTANCE)
    assert got.explain() == (
        "alone vs batched recompute 0.00e+00, 5.050% over the 4 samples checked (upper "
        "quartile); bound 20.200% = 4 x max(those, floor 1e-02)"
    )


@pytest.mark.parametrize(
    "wrong",
    [
        0.50,
        1.00,
        1.53,
    ],  # scaled by 1.5; shifted by a token, another sample's (docs/design/verify.md)
)
def test_wrong_rows_still_fail_under_a_real_models_noise(wrong: float) -> None:
    for own in SMOLLM2_NOISE.values():
        assert not bound(own, SMOLLM2_NOISE).admits(wrong)


def test_one_outlier_widens_only_its_own_bound() -> None:
    noises = {i: 0.01 for i in range(7)} | {7: 0.5}  # 7: a routing near-tie flipped
    assert bound(0.01, noises).value == pytest.approx(NOISE_MULTIPLE * 0.01)
    assert not bound(0.01, noises).admits(0.5)  # others' wrong rows still fail
    assert bound(0.5, noises).admits(0.5 * 1.1)


@pytest.mark.parametrize("dtype", sorted(NOISE_FLOOR))
def test_batch_invariant_recomputes_are_held_to_the_floor(dtype: str) -> None:
    floor = NOISE_FLOOR[dtype]
    got = bound(0.0, dict.fromkeys(range(8), 0.0), floor)
    assert got.value == NOISE_MULTIPLE * floor
    assert got.admits(got.value) and not got.admits(got.value * 1.01)


def test_nan_never_passes_and_never_sets_the_pool() -> None:
    noises = {0: math.nan, 1: 0.02, 2: 0.02}
    assert pooled_noise(noises.values()) == pytest.approx(0.02)
    assert not bound(math.nan, noises).admits(0.0)  # its own recomputes hold NaN rows
    assert not bound(0.02, noises).admits(math.nan)  # its stored rows do
    assert pooled_noise([]) == pooled_noise([math.nan]) == 0.0


def test_one_sample_checked_has_only_its_own_noise() -> None:
    assert bound(0.0, {5: 0.0}).value == NOISE_MULTIPLE * BF16
    assert bound(0.03, {5: 0.03}).value == pytest.approx(NOISE_MULTIPLE * 0.03)
