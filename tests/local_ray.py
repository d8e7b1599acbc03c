"""A real local Ray for tests, advertising GPU-node resources (the worker runs on CPU)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import ray

from tools.ray_head import private_temp_dir


@contextmanager
def local_ray(sglang_nodes: int) -> Iterator[None]:
    # address="local": a new Ray of its own, never a stale cluster found on the machine; and
    # its own temp dir, never another Ray's files.
    with private_temp_dir() as temp_dir:
        ray.init(
            address="local",
            num_cpus=2,
            resources={"sglang_node": sglang_nodes},
            include_dashboard=False,
            log_to_driver=False,
            _temp_dir=temp_dir,
        )
        try:
            yield
        finally:
            ray.shutdown()
