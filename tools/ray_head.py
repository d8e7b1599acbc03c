"""A local Ray head for the demo and the `ray job submit` test, stopped by its own handle.

`ray start --head --block` stays in the foreground and takes the head's processes down with it
when terminated, so stopping it never touches another Ray on the machine (`ray stop` would
stop every one). Every port it opens is a free one, and its files (sessions, sockets, logs,
runtime_env packages) go to a temp dir of its own, removed afterwards, for the same reason: in
Ray's shared default (/tmp/ray) a job once failed to download its runtime_env package while
another Ray ran on the machine (`private_temp_dir` gives the tests' and benchmarks' heads the
same). The head requires a token of its own (Ray's token authentication, on by default for local
clusters since Ray 2.59): clients get it through the environment `local_head` yields, never from
files in $HOME.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import requests

from actors.ports import free_port

BIN = Path(sys.executable).parent  # the venv's ray and python


@contextmanager
def private_temp_dir() -> Iterator[str]:
    """A Ray temp dir of one head's own (`--temp-dir`, `ray.init(_temp_dir=...)`), removed
    afterwards. Short, under /tmp: Ray's Unix socket paths inside it must stay under 108 bytes."""
    path = tempfile.mkdtemp(prefix="hsx-ray-", dir="/tmp")
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@contextmanager
def local_ray(num_cpus: int, **init: Any) -> Iterator[None]:
    """This process's own local Ray (own ports, own temp dir, no dashboard), shut down after:
    for benchmarks that start workers or tasks in-process."""
    import ray

    with private_temp_dir() as temp_dir:
        ray.init(
            address="local", num_cpus=num_cpus, include_dashboard=False, _temp_dir=temp_dir, **init
        )
        try:
            yield
        finally:
            ray.shutdown()


@contextmanager
def local_head(
    resources: dict[str, float], num_cpus: int, log_path: Path, timeout: float = 180.0
) -> Iterator[tuple[str, dict[str, str]]]:
    """Yields the head's job API address (http://127.0.0.1:PORT) and the environment for its
    clients (`ray job submit`, ...): the venv on PATH and the head's auth token."""
    with private_temp_dir() as temp_dir:
        yield from _head(resources, num_cpus, log_path, timeout, temp_dir)


def _head(
    resources: dict[str, float], num_cpus: int, log_path: Path, timeout: float, temp_dir: str
) -> Iterator[tuple[str, dict[str, str]]]:
    dashboard = free_port()
    cmd = [
        str(BIN / "ray"), "start", "--head", "--block", "--disable-usage-stats",
        f"--temp-dir={temp_dir}",
        "--node-ip-address=127.0.0.1",
        f"--port={free_port()}",
        "--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard}",
        f"--ray-client-server-port={free_port()}",
        f"--dashboard-agent-listen-port={free_port()}",
        f"--dashboard-agent-grpc-port={free_port()}",
        f"--runtime-env-agent-port={free_port()}",
        f"--metrics-export-port={free_port()}",
        f"--num-cpus={num_cpus}", "--num-gpus=0",
        f"--resources={json.dumps(resources)}",
    ]  # fmt: skip
    # The job's `python` is the venv's: the job supervisor inherits the head's PATH.
    env = {
        **os.environ,
        "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN": secrets.token_hex(32),
    }
    env.pop("RAY_ADDRESS", None)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "wb") as log:
        head = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    address = f"http://127.0.0.1:{dashboard}"
    try:
        _wait_for_jobs_api(address, env["RAY_AUTH_TOKEN"], head, log_path, timeout)
        yield address, env
    finally:
        head.send_signal(signal.SIGTERM)
        try:
            head.wait(60)
        except subprocess.TimeoutExpired:
            head.kill()
            head.wait()


def _wait_for_jobs_api(
    address: str, token: str, head: subprocess.Popen, log: Path, timeout: float
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if head.poll() is not None:
            raise RuntimeError(
                f"ray start exited with {head.returncode}:\n{log.read_text()[-3000:]}"
            )
        try:
            auth = {"Authorization": f"Bearer {token}"}
            if requests.get(f"{address}/api/jobs/", headers=auth, timeout=2).ok:
                return
        except requests.RequestException:
            pass
        time.sleep(1)
    raise TimeoutError(f"the Ray head's job API at {address} did not come up in {timeout:.0f} s")
