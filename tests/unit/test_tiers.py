"""The fast tier stays fast: a unit test that starts an SGLang server, Ray or the S3 server
without the fixture that marks it is refused, naming the fixture."""

from __future__ import annotations

from pathlib import Path

import pytest
import ray

from actors.sglang_server import ServerSpec, SGLangServer
from patches.settings import CaptureSettings
from tools import s3_server


def test_a_server_ray_or_s3_started_without_its_fixture_is_refused(tmp_path: Path) -> None:
    spec = ServerSpec(model_path=tmp_path, capture=CaptureSettings(None, "hsx-", 1 << 20, True))
    with pytest.raises(RuntimeError, match="without the `start_server` fixture"):
        SGLangServer(spec, tmp_path / "server.log").start()
    with pytest.raises(RuntimeError, match="without the `ray_nodes` fixture"):
        ray.init(address="local")
    with pytest.raises(RuntimeError, match="without the `s3` fixture"):
        s3_server.s3_server()
    assert not (tmp_path / "server.log").exists()


def test_every_unit_test_is_unmarked_by_slow_fixtures(request: pytest.FixtureRequest) -> None:
    """The collection check's premise, seen from inside: this test carries no tier marker."""
    marks = {m.name for m in request.node.iter_markers()}
    assert not marks & {"server", "ray", "s3", "trainers"}
