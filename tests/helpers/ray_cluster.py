"""The session's Ray cluster: three simulated nodes on this machine (ray.cluster_utils.Cluster),
each with one CPU, advertising the resources jobs and workers in tests are placed by:

- the head: PAIR_NODE (a job with `worker.node_resource: PAIR_NODE` and two servers per node
  runs both there);
- two GPU-less "GPU nodes" with `sglang_node` (the default `worker.node_resource`: a job runs
  a server on each), one of them also SOLO_NODE (a job or worker of one server).

A test gets the cluster with every one of those resources free, and must leave it so: a worker
it started and did not stop (one whose run failed, too) would hold its node from the next test.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import ray
from ray._common.utils import get_ray_address_file
from ray.cluster_utils import Cluster

from tools.ray_head import private_temp_dir

PAIR_NODE = "pair_node"
SOLO_NODE = "solo_node"
NODE_RESOURCES = {PAIR_NODE: 1.0, "sglang_node": 2.0, SOLO_NODE: 1.0}


class SimulatedCluster:
    """The session's cluster, started at its first use. A test that leaves a node resource held
    fails, and the cluster is started anew for the next one: one leak fails one test."""

    def __init__(self) -> None:
        self.cluster: Cluster | None = None
        self._temp_dir: contextlib.ExitStack | None = None

    def acquire(self) -> Cluster:
        """The running cluster, every node resource free."""
        if self.cluster is None:
            self._start()
        assert self.cluster is not None
        return self.cluster

    def release(self, timeout: float = 60.0) -> None:
        """After a test: its workers gone, every node resource free again, or a new cluster."""
        try:
            wait_until_free(timeout)
        except AssertionError:
            self.close()
            raise

    def close(self) -> None:
        if self.cluster is None:
            return
        ray.shutdown()
        self.cluster.shutdown()
        self.cluster = None
        assert self._temp_dir is not None
        self._temp_dir.close()

    def _start(self) -> None:
        # Cluster writes the head's address to Ray's default temp dir whatever temp_dir says
        # (ray._common.utils.get_ray_address_file), and fails where that directory was never
        # made: on a machine that never ran Ray, /tmp/ray.
        Path(get_ray_address_file(None)).parent.mkdir(parents=True, exist_ok=True)
        self._temp_dir = contextlib.ExitStack()
        temp_dir = self._temp_dir.enter_context(private_temp_dir())
        cluster = Cluster()
        try:  # a node that fails to start must not leave the others running (ports held)
            # No dashboard: nothing here submits jobs to this cluster (the demo has its own
            # head) and, idle, it took ~4% of a core all session.
            cluster.add_node(
                num_cpus=1, temp_dir=temp_dir, resources={PAIR_NODE: 1}, include_dashboard=False
            )
            cluster.add_node(
                num_cpus=1, temp_dir=temp_dir, resources={"sglang_node": 1, SOLO_NODE: 1}
            )
            cluster.add_node(num_cpus=1, temp_dir=temp_dir, resources={"sglang_node": 1})
            ray.init(address=cluster.address, log_to_driver=False)
        except BaseException:
            cluster.shutdown()
            self._temp_dir.close()
            raise
        self.cluster = cluster


def wait_until_free(timeout: float = 60.0) -> None:
    """Until every node resource is free again (a stopped worker's returns when it is gone)."""
    deadline = time.monotonic() + timeout
    while True:
        free = ray.available_resources()
        held = {k: v - free.get(k, 0.0) for k, v in NODE_RESOURCES.items() if free.get(k, 0.0) < v}
        if not held:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"node resources still held after {timeout:.0f} s: {held}")
        time.sleep(0.2)
