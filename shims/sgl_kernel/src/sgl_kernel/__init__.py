"""Import-only stand-in for the `sgl_kernel` package on CPU-only machines.

SGLang 0.5.23 imports a few `sgl_kernel` names at module load even when it runs on
the CPU, where the real CUDA wheel cannot load (it needs libcuda). Every attribute
of this package and its submodules is a function that raises NotImplementedError
naming the kernel, so an accidental call fails loudly instead of computing garbage.
On a CPU without AMX, SGLang's CPU engine never calls them.
"""

from sgl_kernel._missing import missing_kernel

__version__ = "0.0.1+cpushim"


def __getattr__(name: str):
    return missing_kernel(__name__, name)
