"""What the driver's placement decided for a node, as each of its workers receives it.

cluster/placement.py `plan_node` makes the plan from the node's GPUs and the job's server
section; the driver hands it to every NodeWorker it starts there, with the worker's slot, so
the worker starts its server with the TP size and the GPU group the placement chose rather
than working them out again.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class NodePlan:
    servers: int  # slots 0 .. servers-1, one worker each
    gpus_per_server: int  # tp_size x dp_size; 0 on a CPU node
    tp_size: int = 1  # GPUs of each server's tensor-parallel group (on a CPU node: its ranks)
    idle_gpus: int = 0  # what is left when the node's GPUs do not divide evenly

    @classmethod
    def on_cpu(cls, servers: int, tp_size: int | None) -> NodePlan:
        """`servers` servers on a node with no GPU, each of `tp_size` ranks (null: 1)."""
        return cls(servers, 0, tp_size or 1)
