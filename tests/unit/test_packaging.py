"""The installed distribution: the runtime packages, the C kernels built from source, and the
`hsx` command, nothing else (test helpers, the tiny-model maker and benchmarks are not a user's
importable packages); and, where no compiler works, the same install without the kernel,
saying why, whose readers, status, verify and export import and whose quantizer gives the
definition's bytes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RUNTIME = {"actors", "cluster", "hsx_store", "hsx_kernels", "patches"}
NOT_SOURCES = (
    *(".git", ".venv*", ".cache", "out", "build", "*.egg-info", "__pycache__", ".*cache"),
    "*.so",  # built by the wheel's build, not copied from an in-place one
)


NOT_BUILT = "WARNING: hsx_kernels.fp8_cpu (the CPU FP8 quantizer's kernel) was not built"


def build_wheel(tmp_path: Path, env: dict[str, str] | None = None) -> tuple[Path, str]:
    """The project's wheel, as `pip install` builds it; and the build's log."""
    source = tmp_path / "src"  # a copy: a build writes build/ and *.egg-info beside the sources
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(*NOT_SOURCES))
    build = [sys.executable, "-m", "pip", "wheel", "-v", "--no-deps", "--no-build-isolation"]
    done = subprocess.run(
        [*build, str(source), "-w", str(tmp_path / "dist")],
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    return wheel, done.stdout + done.stderr


def kernels(names: list[str]) -> list[str]:
    return [n for n in names if n.startswith("hsx_kernels/fp8_cpu.") and n.endswith(".so")]


def test_the_wheel_holds_the_runtime_packages_and_the_hsx_command(tmp_path: Path) -> None:
    wheel, log = build_wheel(tmp_path)
    names = zipfile.ZipFile(wheel).namelist()
    packages = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert packages == RUNTIME
    assert kernels(names) and NOT_BUILT not in log
    (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "hsx = cluster.__main__:main" in text  # beside `python -m cluster`
    assert "hidden_capture = patches:register" in text  # SGLang's plugin entry point


# Run with -S and PYTHONPATH: the wheel's files first, then this checkout (for tests/helpers)
# and the venv's site-packages, without the venv's editable install of the project (which finds
# the checkout's kernel).
WITHOUT_THE_KERNEL = """
import importlib.util, json, warnings
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

warnings.simplefilter("always")  # every warning counted, not the first from each line only
import actors.shard_writer, cluster.__main__, cluster.status, cluster.verify
import hsx_store.export.run, hsx_store.integrity, hsx_store.reader
from hsx_store import fp8
from tests.helpers.fp8_rows import edge_rows, every_finite_bf16, rows

x = torch.cat([every_finite_bf16(), edge_rows().repeat(1, 16), rows(64, 256)])
want = fp8.quantize_rows(x)
with warnings.catch_warnings(record=True) as said, ThreadPoolExecutor(2) as pool:
    got = [fp8.quantize(x, "x", pool), fp8.quantize(x, "x")]
    x[3, 7] = float("nan")
    try:
        fp8.quantize(x, "sample 4 aux")
        refused = None
    except ValueError as error:
        refused = str(error)
print(json.dumps({
    "kernel_found": importlib.util.find_spec("hsx_kernels.fp8_cpu") is not None,
    "fp8_from": fp8.__file__,
    "same_bytes": [
        np.array_equal(values, want[0].view(torch.uint8).numpy())
        and np.array_equal(scales, want[1].numpy())
        for values, scales in got
    ],
    "warnings": [str(w.message) for w in said],
    "refused": refused,
}))
"""


def test_without_a_compiler_the_install_goes_on_and_works_without_the_kernel(
    tmp_path: Path,
) -> None:
    """CC names no compiler: the wheel builds without the kernel, its log saying once what is
    missing and what is slower. Installed, its readers, `status`, `verify`, `export` and the
    writer import, and the quantizer gives the definition's bytes (refusing a NaN as before),
    warning once."""
    wheel, log = build_wheel(tmp_path, {"CC": str(tmp_path / "no-such-cc")})
    assert not kernels(zipfile.ZipFile(wheel).namelist())
    assert log.count(NOT_BUILT) == 1 and "Python's headers" in log and "slower" in log, log
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    path = os.pathsep.join([str(site), str(ROOT), sysconfig.get_paths()["purelib"]])
    done = subprocess.run(
        [sys.executable, "-S", "-c", WITHOUT_THE_KERNEL],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": path},
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert not result["kernel_found"] and result["fp8_from"].startswith(str(site))
    assert result["same_bytes"] == [True, True]
    (warning,) = result["warnings"]
    assert "kernel is not built" in warning and "slower" in warning
    assert result["refused"].startswith("sample 4 aux: non-finite value in row (3,)")
