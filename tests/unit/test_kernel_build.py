"""The CPU FP8 kernel built by the oldest compilers GPU nodes run, through setup.py as an install
builds it: Debian's gcc-11 and clang-14 (GCC 11 and Clang 14 are Ubuntu 22.04's; level names
such as "x86-64-v4" need GCC 12 / Clang 18). Each build finds the variants the installed one
finds on this CPU, and every variant gives the definition's bytes. CI installs both compilers
(.ci/run); there, a missing one fails the test rather than skipping it."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from hsx_kernels import fp8_cpu
from tests.helpers.fp8_kernel import check_variant

ROOT = Path(__file__).resolve().parents[2]
# What setup.py's build_ext reads besides the kernel's source: the project's metadata.
METADATA = ("setup.py", "pyproject.toml", "README.md")


def build(compiler: str, source: Path) -> Path:
    """The kernel built from a copy of its sources with `compiler` (CC), as `pip install`
    builds it; the built module's path."""
    ignore = shutil.ignore_patterns("*.so")  # the installed build
    shutil.copytree(ROOT / "hsx_kernels", source / "hsx_kernels", ignore=ignore)
    for name in METADATA:
        shutil.copy(ROOT / name, source / name)
    command = [sys.executable, "setup.py", "build_ext", "--build-lib", "lib", "--build-temp", "tmp"]
    env = {**os.environ, "CC": compiler}
    done = subprocess.run(command, cwd=source, env=env, capture_output=True, text=True)
    log = done.stdout + done.stderr
    assert done.returncode == 0, log
    # setup.py installs without a kernel it cannot build: here that is a failure.
    assert "was not built" not in log, log
    compiled = [line for line in log.splitlines() if " -c hsx_kernels/fp8_cpu.c " in line]
    assert compiled and compiled[0].startswith(f"{compiler} "), log  # by `compiler`
    (built,) = (source / "lib" / "hsx_kernels").glob("fp8_cpu.*.so")
    return built


def load(path: Path) -> ModuleType:
    """The module at `path`, beside the installed hsx_kernels.fp8_cpu (another file)."""
    spec = importlib.util.spec_from_file_location("fp8_cpu", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("compiler", ["gcc-11", "clang-14"])
def test_an_older_compiler_builds_the_kernel_and_every_variant_gives_the_definitions_bytes(
    tmp_path: Path, compiler: str
) -> None:
    if shutil.which(compiler) is None:
        install = f"apt-get install {compiler} (.ci/run does; docs/testing.md)"
        if os.environ.get("CI"):
            pytest.fail(f"{compiler} is not installed, and CI must run this test: {install}")
        pytest.skip(f"{compiler} is not installed: {install}")
    kernel = load(build(compiler, tmp_path))
    assert kernel.variants() == fp8_cpu.variants()  # the same instruction sets found
    for variant in kernel.variants():
        check_variant(kernel, variant)
