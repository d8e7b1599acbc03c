"""Compiled kernels, built when the project is installed (`pip install -e .`: a C compiler and
Python's headers; setup.py lists them), optional: an install that cannot build one goes on
without it, and its caller runs a portable path (docs/getting-started.md). Each node imports
them from its own install: a job's package (ray_configs/runtime_env.yaml) ships Python code
only, and this package is not in it.

- `fp8_cpu`: bf16 rows to e4m3 bits and power-of-two scales on the CPU (hsx_store/fp8.py
  `quantize_into`; `cpu_kernel` imports it, the one import outside tests and benchmarks), the
  shard writer's quantizer for bf16 dumps into an FP8 store.
"""
