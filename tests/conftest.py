"""Fixtures every test shares, and the markers that sort tests into tiers.

A test's markers come from the fixtures it uses, so they cannot be forgotten (FIXTURE_MARKS):
`server` it starts SGLang servers (here or in Ray workers), `ray` a Ray cluster, `s3` the
loopback S3 server, `trainers` the released trainers' venv, `cuda` a GPU (skipped without).
tests/unit holds none of the first four: `make test-fast` runs it, and a unit test that
starts a server, Ray or the S3 server fails, naming the fixture to take it from. How the
tiers and helpers fit: docs/testing.md.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import ray
import torch
from ray.cluster_utils import Cluster

from actors.sglang_server import ServerSpec, SGLangServer
from cluster.verify.server import VerifyServer
from tests.helpers.ray_cluster import SimulatedCluster
from tests.helpers.servers import ServerPool, StartServer, unserved_model_modules
from tools import s3_server as s3_module
from tools.s3_server import S3Server
from tools.tiny_models import ensure_models

ROOT = Path(__file__).resolve().parents[1]
UNIT = ROOT / "tests" / "unit"
TRAINERS_PYTHON = ROOT / ".venv-trainers" / "bin" / "python"

FIXTURE_MARKS = {
    "sglang_servers": {"server"},
    "start_server": {"server"},
    "server_starter": {"server"},  # tests/integration/test_server_lifecycle.py
    "verify_server": {"server"},
    "ray_cluster": {"ray", "server"},  # there for workers, which start servers
    "demo": {"ray", "server"},
    "s3": {"s3"},
    "trainers_python": {"trainers"},
    "cuda_device": {"cuda"},
}
SLOW_MARKS = {"server", "ray", "s3", "trainers"}  # none in tests/unit

# Set before any server or Ray node starts, so every server inherits it: in Ray workers, in
# `ray job submit`'s driver and in a killed worker's replacement too.
os.environ.setdefault("SGLANG_DISABLED_MODEL_ARCHS", unserved_model_modules())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    misplaced = []
    for item in items:
        marks = set().union(*(FIXTURE_MARKS.get(f, set()) for f in item.fixturenames))
        for mark in sorted(marks):
            item.add_marker(mark)
        if marks & SLOW_MARKS and item.path.is_relative_to(UNIT):
            misplaced.append(f"{item.nodeid} ({', '.join(sorted(marks & SLOW_MARKS))})")
    if misplaced:
        raise pytest.UsageError(
            "tests/unit is the fast tier: move these to tests/integration:\n  "
            + "\n  ".join(misplaced)
        )


def _refuse(what: str, fixture: str) -> Callable[..., None]:
    def refused(*args: object, **kwargs: object) -> None:
        raise RuntimeError(
            f"this test starts {what} without the `{fixture}` fixture: take it from there, so "
            "the test is marked and kept out of `make test-fast`"
        )

    return refused


@pytest.fixture(autouse=True)
def _tier_guard(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever a test starts without its fixture (and so without its marker) is refused."""
    marks = {m.name for m in request.node.iter_markers()}
    if "server" not in marks:
        monkeypatch.setattr(SGLangServer, "start", _refuse("an SGLang server", "start_server"))
    if "ray" not in marks:
        monkeypatch.setattr(ray, "init", _refuse("Ray", "ray_nodes"))
        monkeypatch.setattr(Cluster, "__init__", _refuse("a Ray cluster", "ray_nodes"))
    if "s3" not in marks:
        monkeypatch.setattr(s3_module, "s3_server", _refuse("the S3 server", "s3"))


# -- models ------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("models")
    ensure_models(root, ["llama-tiny", "deepseek-v3-tiny"])
    return root


@pytest.fixture(scope="session")
def llama_path(models_dir: Path) -> Path:
    return models_dir / "llama-tiny"


@pytest.fixture(scope="session")
def deepseek_path(models_dir: Path) -> Path:
    return models_dir / "deepseek-v3-tiny"


@pytest.fixture(scope="session")
def qwen25_vl_path(models_dir: Path) -> Path:
    """The tiny Qwen2.5-VL with its processor: made only by the sessions that ask for it."""
    return ensure_models(models_dir, ["qwen25-vl-tiny"])["qwen25-vl-tiny"]


@pytest.fixture(scope="session")
def kimi_k25_path(models_dir: Path) -> Path:
    """The tiny Kimi-K2.5 (DeepseekV3 + MoonViT) with its processor, made on first use."""
    return ensure_models(models_dir, ["kimi-k25-tiny"])["kimi-k25-tiny"]


# -- servers, clusters, storage ---------------------------------------------------------------


@pytest.fixture(scope="session")
def sglang_servers(
    models_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerPool]:
    """Shared patched servers, one per configuration: send them requests, never stop them."""
    pool = ServerPool(models_dir, tmp_path_factory.mktemp("servers"))
    try:
        yield pool
    finally:
        pool.close()


@pytest.fixture
def start_server() -> Iterator[StartServer]:
    """Starts a server of the test's own (to kill, freeze or misconfigure); stopped after it."""
    started: list[SGLangServer] = []

    def start(spec: ServerSpec, log_path: Path, timeout: float = 180.0) -> SGLangServer:
        server = SGLangServer(spec, log_path)
        started.append(server)
        return server.start(timeout)

    try:
        yield start
    finally:
        for server in started:
            server.stop()


@pytest.fixture
def verify_server(tmp_path: Path) -> Iterator[Callable[..., VerifyServer]]:
    """`verify`'s own server for the model checks (started at its first use), closed after."""
    opened: list[VerifyServer] = []

    def open_server(model_path: Path, server_args: list[str]) -> VerifyServer:
        opened.append(VerifyServer(model_path, tmp_path, server_args, print))
        return opened[-1]

    try:
        yield open_server
    finally:
        for server in opened:
            server.close()


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[SimulatedCluster]:
    """The session's Ray cluster (tests/helpers/ray_cluster.py); a test takes `ray_nodes`."""
    cluster = SimulatedCluster()
    try:
        yield cluster
    finally:
        cluster.close()


@pytest.fixture
def ray_nodes(ray_cluster: SimulatedCluster) -> Iterator[Cluster]:
    """The session's Ray cluster, every node resource free before and after the test."""
    yield ray_cluster.acquire()
    ray_cluster.release()


@pytest.fixture(scope="session")
def s3() -> Iterator[S3Server]:
    """One S3 server on loopback for the session; each test uses its own prefix."""
    with s3_module.s3_server() as server:
        yield server


@pytest.fixture(scope="session")
def trainers_python() -> Path:
    """The released trainers' venv (`make setup` builds it)."""
    assert TRAINERS_PYTHON.exists(), f"{TRAINERS_PYTHON} is missing: run `make setup`"
    return TRAINERS_PYTHON


@pytest.fixture
def cuda_device() -> torch.device:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    return torch.device("cuda")


@pytest.fixture
def demo() -> Callable[[list[str]], int]:
    """tools/demo.py's main: a local Ray head, `ray job submit` of the demo job, its server."""
    from tools import demo as demo_module

    return demo_module.main
