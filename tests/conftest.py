"""Shared fixtures: tiny models made locally, and patched SGLang servers on CPU."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tools.s3_server import S3Server, s3_server
from tools.tiny_models import ensure_models


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


@pytest.fixture
def fresh_dir(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "dumps"
    path.mkdir()
    yield path


@pytest.fixture(scope="session")
def s3() -> Iterator[S3Server]:
    """One S3 server on loopback for the session; each test uses its own prefix."""
    with s3_server() as server:
        yield server
