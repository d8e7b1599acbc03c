"""A real local Ray for tests, advertising GPU-node resources (the worker runs on CPU)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import ray


@contextmanager
def local_ray(sglang_nodes: int) -> Iterator[None]:
    # address="local": a new Ray of its own, never a stale cluster found on the machine.
    ray.init(
        address="local",
        num_cpus=2,
        resources={"sglang_node": sglang_nodes},
        include_dashboard=False,
        log_to_driver=False,
    )
    try:
        yield
    finally:
        ray.shutdown()
