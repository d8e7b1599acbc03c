"""One server started as a worker starts it, with the plugin inactive (no dump folder): it
captures nothing, even for a request its prefix would match, and it does not outlive the
process that started it (a worker SIGKILLed: no cleanup runs). One server for both: a start
is ~30 CPU-seconds."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from patches.settings import META_INFO_KEY
from tests.helpers.processes import group_alive, kill_and_wait

STARTER = """
import json, sys, time
from pathlib import Path
from actors.sglang_server import ServerSpec, SGLangServer
from patches.settings import CaptureSettings
spec = ServerSpec(model_path=Path(sys.argv[1]), capture=CaptureSettings.from_env({}))
server = SGLangServer(spec, Path(sys.argv[2])).start()
response = server.session.post(
    server.url + "/generate",
    json={"text": "hi there", "rid": "hsx-would-match", "sampling_params": {"max_new_tokens": 1}},
    timeout=60,
).json()
print(json.dumps(response["meta_info"]), flush=True)
print(server.process.pid, flush=True)
time.sleep(3600)
"""


@pytest.fixture
def server_starter(
    llama_path: Path, tmp_path: Path
) -> Iterator[tuple[subprocess.Popen, dict, int, Path]]:
    """A process that started a server and sent it one request, as a worker does: the
    answer's meta_info, the server's process group id, its log."""
    log = tmp_path / "server.log"
    starter = subprocess.Popen(
        [sys.executable, "-c", STARTER, str(llama_path), str(log)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert starter.stdout is not None
        meta_info = json.loads(starter.stdout.readline())  # the server is healthy by then
        yield starter, meta_info, int(starter.stdout.readline()), log
    finally:
        starter.kill()


def test_an_inactive_plugin_captures_nothing_and_its_server_dies_with_its_starter(
    server_starter: tuple[subprocess.Popen, dict, int, Path],
) -> None:
    starter, meta_info, pgid, log_path = server_starter
    log = log_path.read_text()
    assert META_INFO_KEY not in meta_info
    assert "hidden-capture plugin ACTIVE" in log and "capture=False" in log
    assert "capture=True" not in log

    assert group_alive(pgid)
    kill_and_wait(starter, lambda: group_alive(pgid), 60, "the server")
