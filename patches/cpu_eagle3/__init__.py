"""EAGLE-3 speculative decoding on SGLang 0.5.23's CPU engine.

SGLang's CPU branches of the speculative path call `sgl_kernel` CPU ops that only a compiled
sgl-kernel provides; with our import-only shim each raises NotImplementedError. And its CPU
draft worker is wired for `intel_amx` attention alone. This package supplies what that path
lacks: the ops, in pure torch (ops.py), and the speculative modes of `torch_native` attention
(attention.py). Loaded only on the CPU engine with HIDDEN_CAPTURE_CPU_EAGLE3=1 (patches/
__init__.py); on a GPU nothing of it loads.
"""

from __future__ import annotations

from patches.cpu_eagle3 import attention, ops


def register() -> list[str]:
    """Register every hook; returns their targets."""
    return ops.register() + attention.register()
