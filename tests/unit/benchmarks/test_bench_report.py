"""The benchmark report (benchmarks/report.py) from synthetic RESULT/SKIP output: no benchmark
runs, no Ray."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import matplotlib.image
import pytest

from benchmarks.report import (
    DPI,
    Row,
    chart_size,
    parse_result,
    parse_skip,
    render_chart,
    render_markdown,
    to_row,
    write_report,
)
from benchmarks.rounds import alternate

OUTPUTS = {
    "fast_one": "warming up\nbaseline 5.3 GB/s\nRESULT name=fast_one value=2.9 target=2 unit=GB/s",
    "slow_one": "RESULT name=slow_one value=256 target=2000 unit=round_trips/s",
    "exact": "RESULT name=exact value=0.95 target=0.95 unit=ratio",
    "gpu_only": "checking\nSKIP: needs CUDA",
}

MACHINE = {"date": "2026-01-02 03:04 UTC", "cpus": 2, "cpu_model": "Test CPU", "gpus": []}


def parsed() -> tuple[list[Row], dict[str, str]]:
    rows, skipped = [], {}
    for name, out in OUTPUTS.items():
        lines = out.splitlines()
        if lines[-1].startswith("RESULT "):
            rows.append(to_row(parse_result(lines[-1])))
        else:
            skip = parse_skip(lines)
            assert skip is not None
            skipped[name] = skip
    return rows, skipped


def table_rows(markdown: str) -> dict[str, list[str]]:
    cells = [
        [c.strip() for c in line.strip().strip("|").split("|")]
        for line in markdown.splitlines()
        if line.startswith("| ") and not line.startswith("| benchmark")
    ]
    return {c[0]: c for c in cells}


def test_parse_result_and_skip() -> None:
    assert parse_result("RESULT name=a value=1.5 target=2 unit=GB/s") == {
        "name": "a",
        "value": "1.5",
        "target": "2",
        "unit": "GB/s",
    }
    assert parse_skip(["x", "SKIP: needs CUDA"]) == "needs CUDA"
    assert parse_skip(["RESULT name=a value=1 target=1 unit=u"]) is None


def test_markdown_has_every_row_its_ratio_and_verdict_and_the_skipped() -> None:
    rows, skipped = parsed()
    md = render_markdown(rows, skipped, MACHINE, failed=["broken"])
    table = table_rows(md)
    assert set(table) == {"fast_one", "slow_one", "exact", "gpu_only", "broken"}
    # benchmark, value, target, unit, value/target, result
    assert table["fast_one"] == ["fast_one", "2.9", "2", "GB/s", "1.450", "pass"]
    assert table["slow_one"] == ["slow_one", "256", "2000", "round_trips/s", "0.128", "FAIL"]
    assert table["exact"][4:] == ["1.000", "pass"]  # the target itself passes
    assert table["gpu_only"][-1] == "skipped: needs CUDA"
    assert table["broken"][-1].startswith("error")
    assert "2026-01-02 03:04 UTC" in md
    assert "2 CPUs (Test CPU)" in md and "GPU: none" in md
    assert "2 of 3 measured pass; 1 skipped; 1 failed" in md
    with_gpu = render_markdown(rows, {}, {**MACHINE, "gpus": ["NVIDIA H200"]})
    assert "GPU: NVIDIA H200" in with_gpu


@pytest.mark.parametrize("n_rows", [0, 3])
def test_chart_is_a_png_of_the_expected_size(tmp_path: Path, n_rows: int) -> None:
    rows = parsed()[0][:n_rows]
    path = tmp_path / "sub" / "ratios.png"
    render_chart(rows, path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    image = matplotlib.image.imread(path)
    width, height = chart_size(len(rows))
    assert image.shape[:2] == (round(height * DPI), round(width * DPI))


def test_write_report_writes_both_files(tmp_path: Path) -> None:
    rows, skipped = parsed()
    md, png = write_report(tmp_path / "bench", rows, skipped, machine=MACHINE)
    assert md.read_text() == render_markdown(rows, skipped, MACHINE)
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_rounds_alternate_the_order_and_take_the_median_of_per_round_ratios() -> None:
    calls: list[str] = []
    base_rates = iter([10.0, 10.0, 10.0, 20.0, 10.0])
    ours_rates = iter([9.0, 8.0, 7.0, 2.0, 9.5])

    def side(name: str, rates: Iterator[float]) -> Callable[[], float]:
        return lambda: calls.append(name) or next(rates)

    rounds = alternate(side("base", base_rates), side("ours", ours_rates), rounds=5)
    assert calls == ["base", "ours", "ours", "base", "base", "ours", "ours", "base", "base", "ours"]
    assert rounds.ratios == [0.9, 0.8, 0.7, 0.1, 0.95]
    assert rounds.median == 0.8  # one disturbed round does not move it
    assert rounds.spread == pytest.approx((0.95 - 0.1) / 0.8)
    assert rounds.result_line("x", 0.8) == "RESULT name=x value=0.800 target=0.8 unit=ratio"
    with pytest.raises(ValueError, match="at least 5 rounds"):
        alternate(lambda: 1.0, lambda: 1.0, rounds=4)
