"""Start, health-check and stop one patched SGLang server as its own process group.

    spec = ServerSpec(model_path=..., capture=CaptureSettings(...), aux_layer_ids=[0, 1, 2])
    with SGLangServer(spec, log_path) as server:
        requests.post(server.url + "/generate", ...)

The command line always carries what the capture path depends on: SGLang's own aux capture
(`--enable-return-aux-hidden-states --speculative-algorithm EAGLE3`), `--disable-radix-cache`
(cached prefix tokens are never recomputed, so never captured), loopback host, a free port
and a KV cap. Without a GPU it adds the CPU flags.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import requests
import torch

from patches.settings import CaptureSettings


@dataclass(frozen=True)
class ServerSpec:
    model_path: Path
    capture: CaptureSettings
    # None: SGLang's EAGLE-3 default [2, L//2, L-3], the layers its drafter is served with.
    aux_layer_ids: list[int] | None = None
    tp_size: int = 1
    host: str = "127.0.0.1"
    port: int | None = None  # None: pick a free one
    max_total_tokens: int | None = 8192  # caps the KV pool (CPU would otherwise size ~15 GB)
    chunked_prefill_size: int | None = None
    extra_args: list[str] = field(default_factory=list)
    extra_env: dict[str, str] = field(default_factory=dict)
    device: str | None = None  # None: "cuda" when available, else "cpu"


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def build_command(spec: ServerSpec, port: int) -> list[str]:
    device = spec.device or ("cuda" if torch.cuda.is_available() else "cpu")
    cmd = [
        sys.executable, "-m", "sglang.launch_server",
        "--model-path", str(spec.model_path),
        "--host", spec.host,
        "--port", str(port),
        "--tp-size", str(spec.tp_size),
        "--enable-return-aux-hidden-states",
        "--speculative-algorithm", "EAGLE3",
        "--disable-radix-cache",
    ]  # fmt: skip
    if spec.aux_layer_ids is not None:
        cmd += ["--return-aux-hidden-state-layer-ids", *map(str, spec.aux_layer_ids)]
    if spec.max_total_tokens is not None:
        cmd += ["--max-total-tokens", str(spec.max_total_tokens)]
    if spec.chunked_prefill_size is not None:
        cmd += ["--chunked-prefill-size", str(spec.chunked_prefill_size)]
    if device == "cpu":
        cmd += ["--device", "cpu"]
    return cmd + list(spec.extra_args)


def build_env(spec: ServerSpec) -> dict[str, str]:
    env = dict(os.environ)
    for key in list(env):
        if key.startswith("HIDDEN_CAPTURE_"):
            del env[key]  # the spec, not the caller's environment, configures the plugin
    env.update(spec.capture.to_env())
    # Ray caps OMP_NUM_THREADS at its worker's CPU count (1 by default) and a server started
    # from an actor would inherit it: measured here, that halved CPU prefill throughput.
    env.pop("OMP_NUM_THREADS", None)
    if (spec.device or ("cuda" if torch.cuda.is_available() else "cpu")) == "cpu":
        env["SGLANG_USE_CPU_ENGINE"] = "1"  # without it SGLang's CPU path imports vllm
    env.update(spec.extra_env)
    return env


class ServerError(RuntimeError):
    pass


class SGLangServer:
    def __init__(self, spec: ServerSpec, log_path: Path) -> None:
        self.spec = spec
        self.log_path = log_path
        self.port = spec.port or free_port(spec.host)
        self.url = f"http://{spec.host}:{self.port}"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 180.0) -> SGLangServer:
        """Start the server and return once /health answers; raise with the log tail if not."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                _die_with_parent() + build_command(self.spec, self.port),
                env=build_env(self.spec),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # own process group: stop() reaps every child
            )
        try:
            self.wait_healthy(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.alive():
                raise ServerError(f"SGLang server exited during startup:\n{self.log_tail()}")
            if self.healthy():
                return
            time.sleep(0.5)
        raise ServerError(f"SGLang server not healthy after {timeout:.0f}s:\n{self.log_tail()}")

    def healthy(self) -> bool:
        try:
            return requests.get(self.url + "/health", timeout=5).status_code == 200
        except requests.RequestException:
            return False

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self, grace: float = 10.0) -> None:
        """TERM the process group, wait, then KILL it: SIGTERM alone can leave children."""
        if self.process is None:
            return
        pgid = self.process.pid
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                break
            if _wait_group_gone(self.process, wait):
                break
        self.process.wait(timeout=5)
        self.process = None

    def log_tail(self, max_bytes: int = 4000) -> str:
        try:
            data = self.log_path.read_bytes()
        except FileNotFoundError:
            return "(no log)"
        return data[-max_bytes:].decode(errors="replace")

    def __enter__(self) -> SGLangServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _die_with_parent() -> list[str]:
    """A command prefix that sends the server SIGTERM when the process that started it dies,
    so a crashed or killed worker never leaves an orphaned server holding the node's GPUs
    (the server runs in its own session, out of reach of its parent's group)."""
    setpriv = shutil.which("setpriv")  # util-linux; prctl(PR_SET_PDEATHSIG), kept across exec
    return [setpriv, "--pdeathsig", "TERM", "--"] if setpriv else []


def _wait_group_gone(leader: subprocess.Popen[bytes], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        leader.poll()  # reap the leader, or its zombie keeps the group "alive"
        try:
            os.killpg(leader.pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False
