"""Server placement: how many servers (workers) a node runs and on how many GPUs each, the
driver's slots, and the per-DP-rank bookkeeping of dumps; no server, no Ray cluster."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from actors.node_plan import NodePlan
from cluster.config import ConfigError, parse_config
from cluster.driver import Driver, _Running
from cluster.placement import PlacementError, plan_node, resource_share


@pytest.mark.parametrize(
    ("gpus", "tp", "dp", "per_node", "plan"),
    [
        (8, None, 1, None, NodePlan(1, 8, tp_size=8)),  # the default: one server on every GPU
        (8, 2, 1, None, NodePlan(4, 2, tp_size=2)),
        (8, 3, 1, None, NodePlan(2, 3, tp_size=3, idle_gpus=2)),
        (8, None, 1, 4, NodePlan(4, 2, tp_size=2)),  # tp_size null: an even share of the node
        (8, 2, 2, None, NodePlan(2, 4, tp_size=2)),  # dp replicas multiply a server's GPUs
        (8, None, 2, None, NodePlan(1, 8, tp_size=4)),
        (8, 2, 1, 2, NodePlan(2, 2, tp_size=2, idle_gpus=4)),
        (0, None, 1, None, NodePlan(1, 0, tp_size=1)),  # a CPU node: one server ...
        (0, 4, 1, 3, NodePlan(3, 0, tp_size=4)),  # ... or exactly as many as asked
    ],
)
def test_servers_per_node_follow_gpus_tp_dp_and_the_explicit_count(
    gpus: int, tp: int | None, dp: int, per_node: int | None, plan: NodePlan
) -> None:
    assert plan_node("n", gpus, tp, dp, per_node) == plan


@pytest.mark.parametrize(
    ("gpus", "tp", "dp", "per_node", "needs"),
    [
        (8, 16, 1, None, "1 server(s) x tp_size 16 x dp_size 1 (needs 16"),
        (8, 4, 1, 3, "3 server(s) x tp_size 4 x dp_size 1 (needs 12"),
        (8, None, 1, 16, "16 server(s) x tp_size >= 1 x dp_size 1 (needs 16"),
        (4, 2, 3, None, "1 server(s) x tp_size 2 x dp_size 3 (needs 6"),
    ],
)
def test_a_node_too_small_for_its_servers_is_an_error_naming_it(
    gpus: int, tp: int | None, dp: int, per_node: int | None, needs: str
) -> None:
    with pytest.raises(PlacementError, match=r"node 10\.0\.0\.7 \(abcd\) has") as exc:
        plan_node("10.0.0.7 (abcd)", gpus, tp, dp, per_node)
    assert needs in str(exc.value) and isinstance(exc.value, ConfigError)


@pytest.mark.parametrize("servers", range(1, 17))
def test_resource_shares_always_fit_one_unit(servers: int) -> None:
    # Ray keeps 4 decimals: 1/7 rounded to nearest (0.1429) x 7 would exceed the unit.
    share = resource_share(servers)
    assert 0 < share * servers <= 1 and round(share, 4) == share


def node(address: str, node_id: str, gpus: int = 0, resource: float = 1.0) -> dict[str, Any]:
    resources = {"sglang_node": resource, **({"GPU": float(gpus)} if gpus else {})}
    return {"NodeID": node_id, "NodeManagerAddress": address, "Alive": True, "Resources": resources}


class PlanningDriver(Driver):
    """The driver's slot bookkeeping, with the actor start recorded instead of made."""

    def _start_worker(self, node: dict, plan: NodePlan, slot: int, queue: Any) -> None:
        self.incarnation += 1
        worker_id = f"{node['NodeManagerAddress']}-{node['NodeID'][:8]}-s{slot}-w{self.incarnation}"
        self.workers[worker_id] = _Running(node["NodeID"], worker_id, None, slot)


def driver(
    monkeypatch: pytest.MonkeyPatch, nodes: list[dict], **sections: dict
) -> tuple[PlanningDriver, list[str]]:
    """A driver whose Ray reports `nodes`; what it says goes to the list."""
    raw = {"model": {"path": "m"}, "data": {"paths": ["d"]}, "store": {"url": "s"}, **sections}
    monkeypatch.setattr("cluster.driver.ray.nodes", lambda: nodes)
    said: list[str] = []
    return PlanningDriver(parse_config(raw), say=said.append), said


def test_the_driver_runs_a_worker_per_slot_and_replaces_a_lost_one_in_its_slot(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    gpu_node, cpu_node = node("10.0.0.1", "a" * 16, gpus=8), node("10.0.0.2", "b" * 16)
    d, said = driver(
        monkeypatch,
        [gpu_node, cpu_node, node("10.0.0.3", "c" * 16, resource=0)],  # no sglang_node
        server={"tp_size": 2},
        worker={"max_node_failures": 2},
    )
    d._start_missing_workers(None)
    assert sorted(d.workers) == [
        *(f"10.0.0.1-aaaaaaaa-s{s}-w{s + 1}" for s in range(4)),
        "10.0.0.2-bbbbbbbb-s0-w5",
    ]
    assert "node 10.0.0.1 (aaaaaaaa): 4 server(s) of 2 GPU(s)" in said

    # Slot 2 of the GPU node loses its worker: the replacement takes slot 2, nothing else moves.
    del d.workers["10.0.0.1-aaaaaaaa-s2-w3"]
    d.node_failures[("a" * 16, 2)] = 1
    d._start_missing_workers(None)
    assert "10.0.0.1-aaaaaaaa-s2-w6" in d.workers and len(d.workers) == 5
    # ... until the slot has lost max_node_failures workers: then it stays empty.
    del d.workers["10.0.0.1-aaaaaaaa-s2-w6"]
    d.node_failures[("a" * 16, 2)] = 2
    d._start_missing_workers(None)
    assert len(d.workers) == 4 and not any("-s2-" in w for w in d.workers if "aaaa" in w)


def test_a_cpu_node_runs_servers_per_node_and_a_node_too_small_is_left_out(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    nodes = [node("10.0.0.1", "a" * 16), node("10.0.0.2", "b" * 16, gpus=2)]
    d, said = driver(monkeypatch, nodes, server={"tp_size": 2}, worker={"servers_per_node": 3})
    d._start_missing_workers(None)
    assert sorted(d.workers) == [f"10.0.0.1-aaaaaaaa-s{s}-w{s + 1}" for s in range(3)]
    too_small = "node 10.0.0.2 (bbbbbbbb) has 2 GPU(s), too few for 3 server(s) x tp_size 2"
    d._start_missing_workers(None)
    assert [line for line in said if "too few" in line] == [
        f"{too_small} x dp_size 1 (needs 6; see worker.servers_per_node, server.tp_size, "
        "server.dp_size): no server there"
    ], "said once, not at every look"


def test_a_job_no_node_of_which_can_host_a_server_stops_with_a_config_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    d, _ = driver(monkeypatch, [node("10.0.0.2", "b" * 16, gpus=4)], server={"tp_size": 8})
    with pytest.raises(PlacementError, match=r"no node can host a server:\n.*10\.0\.0\.2"):
        d._start_missing_workers(None)


class _Recorded:
    """NodeWorker's Ray surface, recording how each worker was started."""

    def __init__(self) -> None:
        self.starts: list[tuple[dict[str, Any], tuple, dict[str, Any]]] = []

    def options(self, **options: Any) -> Any:
        def remote(*args: Any, **kwargs: Any) -> Any:
            self.starts.append((options, args, kwargs))
            run = SimpleNamespace(remote=lambda: object())  # a fresh ref per worker
            return SimpleNamespace(run=run)

        return SimpleNamespace(remote=remote)


def test_each_worker_is_handed_its_nodes_plan_and_its_slot(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The placement's decision reaches the worker: the TP size its server runs at is the
    plan's, not one the worker works out again from the GPUs it sees."""
    monkeypatch.setattr("cluster.driver.ray.nodes", lambda: [node("10.0.0.1", "a" * 16, gpus=8)])
    raw = {"model": {"path": "m"}, "data": {"paths": ["d"]}, "store": {"url": "s"}}
    sections = {"server": {"dp_size": 2}, "worker": {"servers_per_node": 2}}
    d = Driver(parse_config({**raw, **sections}), say=lambda _: None)
    recorded = _Recorded()
    monkeypatch.setattr("cluster.driver.NodeWorker", recorded)
    monkeypatch.setattr("cluster.driver.NodeAffinitySchedulingStrategy", lambda *a, **k: None)
    d._start_missing_workers(None)
    plan = NodePlan(2, 4, tp_size=2)  # 8 GPUs, 2 servers of tp 2 x dp 2
    assert [(o["num_gpus"], kw) for o, _, kw in recorded.starts] == [
        (4, {"plan": plan, "slot": 0}),
        (4, {"plan": plan, "slot": 1}),
    ]
