"""Where the servers go: how many on a node, and how many GPUs each (pure; no Ray).

A server is one SGLang process group of tp_size x dp_size GPUs (tp_size GPUs per data-parallel
replica), served by its own NodeWorker. A node hosts `servers` of them, each in a slot of its
own; Ray pins each worker to its GPUs (num_gpus), so a server sees only its group. The plan
(actors/node_plan.py) goes to each worker the driver starts: its server's TP size is the plan's.
Details: docs/running-a-job.md.
"""

from __future__ import annotations

from actors.node_plan import NodePlan
from cluster.config import ConfigError


class PlacementError(ConfigError):
    """The configured servers do not fit a node; the message names the node."""


def plan_node(
    node: str, gpus: int, tp_size: int | None, dp_size: int, servers_per_node: int | None
) -> NodePlan:
    """The servers `node` (named in errors) hosts with `gpus` GPUs.

    GPU node: tp_size null shares the node's GPUs evenly between its servers (servers_per_node
    of them, else one); servers_per_node null fits as many servers as the GPUs hold. CPU node:
    servers_per_node servers (else one), on no GPU, each of tp_size ranks (else one)."""
    if gpus == 0:
        return NodePlan.on_cpu(servers_per_node or 1, tp_size)
    tp = tp_size or gpus // ((servers_per_node or 1) * dp_size)
    per_server = tp * dp_size
    servers = servers_per_node or (gpus // per_server if per_server else 0)
    if not per_server or not servers or servers * per_server > gpus:
        count, tp_text = servers_per_node or 1, tp_size or ">= 1"
        raise PlacementError(
            f"node {node} has {gpus} GPU(s), too few for {count} server(s) x tp_size {tp_text} "
            f"x dp_size {dp_size} (needs {count * (tp_size or 1) * dp_size}; see "
            "worker.servers_per_node, server.tp_size, server.dp_size)"
        )
    return NodePlan(servers, per_server, tp, gpus - servers * per_server)


def resource_share(servers: int) -> float:
    """Each worker's share of the node's one unit of `worker.node_resource`, rounded down to
    Ray's 1e-4 resource precision so that `servers` shares always fit (1/7 would round up)."""
    return int(10_000 / servers) / 10_000
