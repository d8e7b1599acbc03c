"""The one thing pyproject.toml cannot say without setuptools' experimental `ext-modules`: the
CPU FP8 quantizer's kernel, C, built at install where a C compiler and Python's headers are
there. One build holds a variant per x86-64 instruction set, picked at load
(hsx_kernels/fp8_cpu.c). The kernel is optional: where it cannot be built, the install goes on
without it, saying why, and hsx_store/fp8.py quantizes with its definition instead."""

import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.errors import CCompilerError, ExecError, PlatformError

NOT_BUILT = """
********************************************************************************
WARNING: {name} (the CPU FP8 quantizer's kernel) was not built: {error}
It needs a C compiler ({compiler}; set CC to use another) and Python's headers (Python.h;
Debian/Ubuntu: python3-dev, RHEL: python3-devel). The install goes on without it: everything
works, but the shard writer quantizes bf16 rows for an FP8 store with the definition in torch
(hsx_store/fp8.py), an order of magnitude slower (docs/getting-started.md). Reinstall once a
compiler is there to build it.
********************************************************************************
"""


class OptionalBuildExt(build_ext):
    """build_ext that installs without an extension it cannot compile or link, saying why."""

    def build_extension(self, ext: Extension) -> None:
        try:
            super().build_extension(ext)
        except (CCompilerError, ExecError, PlatformError) as error:
            compiler = getattr(self.compiler, "compiler_so", None) or ["none found"]
            message = NOT_BUILT.format(name=ext.name, error=error, compiler=compiler[0])
            sys.stderr.write(message)


setup(
    cmdclass={"build_ext": OptionalBuildExt},
    ext_modules=[
        Extension(
            "hsx_kernels.fp8_cpu",
            sources=["hsx_kernels/fp8_cpu.c"],
            # Its vectors are passed only to inlined functions: GCC's note on their ABI is noise.
            extra_compile_args=["-Wno-psabi"],
            optional=True,  # setuptools' steps after the build (editable copies) then skip it
        )
    ],
)
