"""Integration fixtures: what several modules check on the same real job."""

from __future__ import annotations

from pathlib import Path

import pytest

from cluster.config import parse_config
from cluster.driver import run_job
from tests.helpers.jobs import FinishedJob, job_config
from tests.helpers.prompts import write_prompts
from tests.helpers.ray_cluster import SimulatedCluster


@pytest.fixture(scope="session")
def deepseek_job(
    ray_cluster: SimulatedCluster, deepseek_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> FinishedJob:
    """One job on the tiny DeepseekV3 (served in float32, layers [0, 1, 3]) over both sglang
    nodes: 12 good rows (chat and text) and 5 bad ones, 3 samples a shard. Read it only; copy
    the store to change it."""
    root = tmp_path_factory.mktemp("deepseek-job")
    rows = write_prompts(root / "prompts.jsonl", 12, bad=True)
    config = job_config(deepseek_path, root / "prompts.jsonl", root / "s.zarr", root)
    log: list[str] = []
    ray_cluster.acquire()
    assert run_job(parse_config(config), say=log.append) == 0, "\n".join(log)[-6000:]
    ray_cluster.release()
    return FinishedJob(root / "s.zarr", rows, log, config)
