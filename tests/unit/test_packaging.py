"""The installed distribution: the runtime packages, the C kernels built from source, and the
`hsx` command, nothing else (test helpers, the tiny-model maker and benchmarks are not a user's
importable packages)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RUNTIME = {"actors", "cluster", "hsx_store", "hsx_kernels", "patches"}
NOT_SOURCES = (
    *(".git", ".venv*", ".cache", "out", "build", "*.egg-info", "__pycache__", ".*cache"),
    "*.so",  # built by the wheel's build, not copied from an in-place one
)


def test_the_wheel_holds_the_runtime_packages_and_the_hsx_command(tmp_path: Path) -> None:
    source = tmp_path / "src"  # a copy: a build writes build/ and *.egg-info beside the sources
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(*NOT_SOURCES))
    build = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation"]
    subprocess.run([*build, str(source), "-w", str(tmp_path / "dist")], check=True)
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    packages = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert packages == RUNTIME
    assert [n for n in names if n.startswith("hsx_kernels/fp8_cpu.") and n.endswith(".so")]
    (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "hsx = cluster.__main__:main" in text  # beside `python -m cluster`
    assert "hidden_capture = patches:register" in text  # SGLang's plugin entry point
