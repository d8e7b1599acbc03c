"""The server launcher: SGLang gets its keys intact, and a server must not outlive the process
that started it."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from sglang.srt.server_args import ServerArgs
from sglang.srt.utils.server_args_config_parser import ConfigArgumentMerger

from actors.sglang_server import ServerSpec, SGLangServer, build_command
from patches.settings import CaptureSettings

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


def test_sglang_reads_back_every_key_the_launcher_gives_it(tmp_path: Path) -> None:
    """Through SGLang's own config merging and parser: a key argparse took for an option (a
    url-safe token starting with '-') failed one server start in ~30."""
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    spec = ServerSpec(model_path=tmp_path, capture=CaptureSettings.from_env({}), device="cpu")
    for _ in range(300):
        server = SGLangServer(spec, tmp_path / "server.log")
        keys_file = server._write_keys()
        argv = build_command(spec, server.port, keys_file)[3:]  # after `python -m module`
        parsed = parser.parse_args(ConfigArgumentMerger(parser).merge_config_with_args(argv))
        assert (parsed.api_key, parsed.admin_api_key) == (server._api_key, server._admin_api_key)
        keys_file.unlink()


@pytest.mark.slow
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
        kill_and_wait(starter, lambda: group_alive(pgid), 60, "the server")
    finally:
        starter.kill()


def kill_and_wait(
    starter: subprocess.Popen, alive: Callable[[], bool], timeout: float, what: str
) -> None:
    """SIGKILL the starter (no cleanup of its own runs) and wait until `alive()` is false."""
    starter.send_signal(signal.SIGKILL)
    starter.wait(timeout=10)
    deadline = time.monotonic() + timeout
    while alive():
        assert time.monotonic() < deadline, f"{what} outlived its starter"
        time.sleep(0.05)


LAUNCHER = """
import os, subprocess, sys, time
child = subprocess.Popen(
    [sys.executable, "-m", "actors.die_with_parent", str(os.getpid()), "--", "sleep", "600"],
    start_new_session=True,
)
print(child.pid, flush=True)
time.sleep(600)
"""


def running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's zombie may wait for a reaper that never comes)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_die_with_parent_takes_the_command_down_with_its_starter() -> None:
    starter = subprocess.Popen([sys.executable, "-c", LAUNCHER], stdout=subprocess.PIPE, text=True)
    try:
        pid = int(starter.stdout.readline())
        deadline = time.monotonic() + 30
        while b"sleep" not in Path(f"/proc/{pid}/cmdline").read_bytes():  # exec'd by now
            assert time.monotonic() < deadline
            time.sleep(0.05)
        kill_and_wait(starter, lambda: running(pid), 10, "the command")
    finally:
        starter.kill()


def test_die_with_parent_refuses_to_start_for_a_parent_already_gone() -> None:
    launched = subprocess.run(
        [sys.executable, "-m", "actors.die_with_parent", "1", "--", "sleep", "600"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert launched.returncode != 0 and "parent 1 is gone" in launched.stderr
