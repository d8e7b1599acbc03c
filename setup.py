"""The one thing pyproject.toml cannot say without setuptools' experimental `ext-modules`: the
CPU FP8 quantizer's kernel, C, built at install (needs a C compiler and Python's headers). One
build holds a variant per x86-64 instruction set, picked at load (hsx_kernels/fp8_cpu.c)."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "hsx_kernels.fp8_cpu",
            sources=["hsx_kernels/fp8_cpu.c"],
            # Its vectors are passed only to inlined functions: GCC's note on their ABI is noise.
            extra_compile_args=["-Wno-psabi"],
        )
    ]
)
