"""Calibration's bookkeeping per DP rank: each rank dumps into its own folder and is checked
against its own counter."""

from __future__ import annotations

from pathlib import Path

from actors.calibration_result import Calibration
from patches.capture_hook import CaptureRank


def test_each_dp_rank_dumps_into_its_own_folder_and_is_checked_against_its_own_counter(
    tmp_path: Path,
) -> None:
    assert CaptureRank(writes=True, dp_rank=None).dump_root(tmp_path) == tmp_path
    assert CaptureRank(writes=True, dp_rank=1).dump_root(tmp_path) == tmp_path / "dp1"
    # The probe was dump 0 of rank 1: rank 0's dump 0 is new, rank 1's dump 0 is the probe.
    calibration = Calibration(offset=0, probe_tokens=5, seconds=0.1, dp_rank=1)
    assert not calibration.precedes_probe({"index": 0, "dp_rank": 0})
    assert calibration.precedes_probe({"index": 0, "dp_rank": 1})
    assert not calibration.precedes_probe({"index": 1, "dp_rank": 1})
    single = Calibration(offset=3, probe_tokens=5, seconds=0.1)  # no DP: one counter
    assert single.precedes_probe({"index": 3, "dp_rank": None})
    assert not single.precedes_probe({"index": 4, "dp_rank": None})
