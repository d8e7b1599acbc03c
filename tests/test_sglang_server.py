"""The server launcher: a server must not outlive the process that started it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

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


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def test_server_dies_with_the_process_that_started_it(llama_path: Path, tmp_path: Path) -> None:
    """A worker killed outright (SIGKILL: no cleanup runs) must not orphan its server."""
    starter = subprocess.Popen(
        [sys.executable, "-c", STARTER, str(llama_path), str(tmp_path / "server.log")],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        pgid = int(starter.stdout.readline())  # the server is healthy by then
        assert group_alive(pgid)
        starter.send_signal(signal.SIGKILL)
        starter.wait(timeout=10)
        deadline = time.monotonic() + 60
        while group_alive(pgid):
            assert time.monotonic() < deadline, "the server outlived its starter"
            time.sleep(0.5)
    finally:
        starter.kill()
