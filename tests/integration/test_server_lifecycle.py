"""A server must not outlive the process that started it (a worker SIGKILLed: no cleanup runs)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers.processes import group_alive, kill_and_wait

STARTER = """
import sys, time
from pathlib import Path
from actors.sglang_server import ServerSpec, SGLangServer
from patches.settings import CaptureSettings
spec = ServerSpec(model_path=Path(sys.argv[1]), capture=CaptureSettings.from_env({}))
server = SGLangServer(spec, Path(sys.argv[2])).start()
print(server.process.pid, flush=True)
time.sleep(3600)
"""


@pytest.fixture
def server_starter(llama_path: Path, tmp_path: Path) -> Iterator[tuple[subprocess.Popen, int]]:
    """A process that started a server (the server's process group id), as a worker does."""
    starter = subprocess.Popen(
        [sys.executable, "-c", STARTER, str(llama_path), str(tmp_path / "server.log")],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert starter.stdout is not None
        yield starter, int(starter.stdout.readline())  # the server is healthy by then
    finally:
        starter.kill()


def test_server_dies_with_the_process_that_started_it(
    server_starter: tuple[subprocess.Popen, int],
) -> None:
    """A worker killed outright (SIGKILL: no cleanup runs) must not orphan its server."""
    starter, pgid = server_starter
    assert group_alive(pgid)
    kill_and_wait(starter, lambda: group_alive(pgid), 60, "the server")
