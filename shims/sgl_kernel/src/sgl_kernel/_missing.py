"""Attribute factory shared by every module of the shim."""

from collections.abc import Callable
from typing import NoReturn


def missing_kernel(module: str, name: str) -> Callable[..., NoReturn]:
    """A stand-in for kernel `module.name` that fails loudly when called."""
    if name.startswith("__"):
        # Keep Python's own protocol lookups (__path__, __file__, ...) honest.
        raise AttributeError(name)

    def kernel(*args: object, **kwargs: object) -> NoReturn:
        raise NotImplementedError(
            f"sgl_kernel CPU shim: kernel {module}.{name} is not available. This "
            "environment has no compiled sgl-kernel; only SGLang's pure-torch CPU path works."
        )

    kernel.__name__ = kernel.__qualname__ = name
    kernel.__module__ = module
    return kernel
