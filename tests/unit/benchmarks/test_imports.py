"""Every benchmark script imports: a rename elsewhere must not break one unnoticed (they run
only under `make bench`)."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

from benchmarks.run import NOT_BENCHMARKS

BENCHMARKS = sorted(
    p.stem
    for p in (Path(__file__).resolve().parents[3] / "benchmarks").glob("*.py")
    if p.stem not in NOT_BENCHMARKS
)


@pytest.mark.parametrize("name", BENCHMARKS)
def test_the_benchmark_imports_and_has_a_main(name: str) -> None:
    module = importlib.import_module(f"benchmarks.{name}")
    assert callable(module.main)
