"""Start, health-check and stop one patched SGLang server as its own process group.

    spec = ServerSpec(model_path=..., capture=CaptureSettings(...), aux_layer_ids=[0, 1, 2])
    with SGLangServer(spec, log_path) as server:
        server.session.post(server.url + "/generate", ...)

The command line carries what capture depends on (SGLang's aux capture,
`--disable-radix-cache`), a loopback host, a free port and a KV cap; the CPU flags without a
GPU. A spec with a `DraftSpec` serves that EAGLE-3 draft instead of capturing (on CPU through
patches/cpu_eagle3/), one with `plain` decodes without either (the draft benchmark's pair).
The server requires fresh API keys (given in a 0600 file, masked in its log), runs with umask
077 and dies with the process that started it (actors/die_with_parent.py).

The flags: docs/design/capture-plugin.md; the keys and files: docs/security.md.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import requests
import torch

from actors.ports import free_port
from actors.process_group import group_pids, kill_group, shm_files
from actors.server_log import RedactedLog
from patches.settings import ENV_CPU_EAGLE3, CaptureSettings


@dataclass(frozen=True)
class DraftSpec:
    """An EAGLE-3 draft served beside the target (`hsx draft-bench`): a chain of `num_steps`
    draft tokens, verified `num_draft_tokens` at a time (topk 1, what CPU serving runs)."""

    path: Path
    num_steps: int = 3
    topk: int = 1
    num_draft_tokens: int = 4

    def args(self) -> list[str]:
        return [
            "--speculative-draft-model-path", str(self.path),
            "--speculative-num-steps", str(self.num_steps),
            "--speculative-eagle-topk", str(self.topk),
            "--speculative-num-draft-tokens", str(self.num_draft_tokens),
        ]  # fmt: skip


@dataclass(frozen=True)
class ServerSpec:
    model_path: Path
    capture: CaptureSettings
    # None: SGLang's EAGLE-3 default [2, L//2, L-3], the layers its drafter is served with.
    aux_layer_ids: list[int] | None = None
    tp_size: int = 1
    dp_size: int = 1  # SGLang --dp-size: replicas in one server, each of tp_size GPUs
    host: str = "127.0.0.1"
    port: int | None = None  # None: pick a free one
    max_total_tokens: int | None = 8192  # caps the KV pool (CPU would otherwise size ~15 GB)
    chunked_prefill_size: int | None = None
    extra_args: list[str] = field(default_factory=list)
    extra_env: dict[str, str] = field(default_factory=dict)
    device: str | None = None  # None: "cuda" when available, else "cpu"
    # Serve this draft (speculative decoding) instead of SGLang's aux-state capture path.
    draft: DraftSpec | None = None
    # Neither that path nor a draft: plain decoding (the draft benchmark's baseline).
    plain: bool = False

    def __post_init__(self) -> None:
        serves = self.draft is not None or self.plain
        if serves and (self.capture.capture_enabled or self.aux_layer_ids is not None):
            raise ValueError("a server that decodes plainly or serves a draft captures nothing")
        if self.draft is not None and self.plain:
            raise ValueError("a server serves a draft or decodes plainly, not both")

    @property
    def resolved_device(self) -> str:
        return self.device or ("cuda" if torch.cuda.is_available() else "cpu")


def build_command(spec: ServerSpec, port: int, keys_file: Path) -> list[str]:
    device = spec.resolved_device
    cmd = [
        sys.executable, "-m", "sglang.launch_server",
        "--config", str(keys_file),  # the API keys: never on the command line
        "--model-path", str(spec.model_path),
        "--host", spec.host,
        "--port", str(port),
        "--tp-size", str(spec.tp_size),
        "--dp-size", str(spec.dp_size),
        "--disable-radix-cache",
        # An idle scheduler waits on its sockets instead of spinning: measured here, an idle
        # CPU server took a whole core (101%) without it, 1.7% with it; a request wakes it.
        "--sleep-on-idle",
    ]  # fmt: skip
    if spec.draft is not None:
        cmd += ["--speculative-algorithm", "EAGLE3", *spec.draft.args()]
    elif not spec.plain:  # capture: SGLang returns aux states only on its EAGLE-3 path
        cmd += ["--enable-return-aux-hidden-states", "--speculative-algorithm", "EAGLE3"]
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
    if spec.draft is not None and spec.resolved_device == "cpu":
        env[ENV_CPU_EAGLE3] = "1"  # the plugin's CPU EAGLE-3 ops and attention modes
    # Ray caps OMP_NUM_THREADS at its worker's CPU count (1 by default) and a server started
    # from an actor would inherit it: measured here, that halved CPU prefill throughput.
    env.pop("OMP_NUM_THREADS", None)
    if spec.resolved_device == "cpu":
        env["SGLANG_USE_CPU_ENGINE"] = "1"  # without it SGLang's CPU path imports vllm
        ranks = spec.tp_size * spec.dp_size
        if ranks > 1 and "SGLANG_CPU_OMP_THREADS_BIND" not in env:
            # Else SGLang refuses more ranks than NUMA nodes ("SGLANG_CPU_OMP_THREADS_BIND is
            # not set, in this case, the total number of ranks ... should be smaller than or
            # equal to number of numa node"): give each rank its share of our CPUs.
            env["SGLANG_CPU_OMP_THREADS_BIND"] = cpu_bind_groups(
                sorted(os.sched_getaffinity(0)), ranks
            )
    env.update(spec.extra_env)
    return env


def cpu_bind_groups(cpus: list[int], ranks: int) -> str:
    """`0-15|16-31`: sorted `cpus` split into `ranks` groups (ranks share a CPU when fewer),
    each written as runs (`0-3,8-11`, a libnuma CPU string)."""
    groups = []
    for r in range(ranks):
        part = cpus[r * len(cpus) // ranks : (r + 1) * len(cpus) // ranks] or [cpus[r % len(cpus)]]
        runs: list[list[int]] = []
        for cpu in part:
            if runs and cpu == runs[-1][1] + 1:
                runs[-1][1] = cpu
            else:
                runs.append([cpu, cpu])
        groups.append(",".join(f"{a}-{b}" if b > a else str(a) for a, b in runs))
    return "|".join(groups)


class ServerError(RuntimeError):
    pass


def new_key() -> str:
    """A random API key. Hex, because SGLang turns its config file into argv and argparse reads a
    value that starts with '-' (1 in 64 url-safe tokens) as an option."""
    return secrets.token_hex(32)


class SGLangServer:
    def __init__(self, spec: ServerSpec, log_path: Path) -> None:
        self.spec = spec
        self.log_path = log_path
        self.port = spec.port or free_port(spec.host)
        self.url = f"http://{spec.host}:{self.port}"
        self.process: subprocess.Popen[bytes] | None = None
        self._api_key, self._admin_api_key = new_key(), new_key()
        self.session = requests.Session()  # for every request to this server: it sends the key
        self.session.headers["Authorization"] = f"Bearer {self._api_key}"
        self._log: RedactedLog | None = None
        self.shm_files: list[Path] = []  # its segments in /dev/shm; stop() removes them

    def start(self, timeout: float = 180.0) -> SGLangServer:
        """Start the server and return once /health answers; raise with the log tail if not."""
        self.log_path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        keys_file = self._write_keys()
        try:
            launcher = [sys.executable, "-m", "actors.die_with_parent", str(os.getpid()), "--"]
            self.process = subprocess.Popen(
                [*launcher, *build_command(self.spec, self.port, keys_file)],
                env=build_env(self.spec),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # own process group: stop() reaps every child
                umask=0o077,
            )
            assert self.process.stdout is not None
            keys = (self._api_key, self._admin_api_key)
            self._log = RedactedLog(self.process.stdout, self.log_path, keys)
            self.wait_healthy(timeout)
            self.shm_files = shm_files(group_pids(self.process.pid))
        except BaseException:
            self.stop()
            raise
        finally:
            keys_file.unlink(missing_ok=True)  # read at startup; an answer on /health is later
        return self

    def _write_keys(self) -> Path:
        """A config file (0600, beside the log) that gives SGLang its two keys (JSON is YAML)."""
        fd, path = tempfile.mkstemp(prefix="keys-", suffix=".yaml", dir=self.log_path.parent)
        with os.fdopen(fd, "w") as f:
            json.dump({"api-key": self._api_key, "admin-api-key": self._admin_api_key}, f)
        return Path(path)

    def wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.alive():
                if self._log is not None:
                    self._log.close()  # its last words copied into the log first
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

    def stop(self) -> None:
        """KILL the process group. SGLang's own shutdown (SIGTERM) took 6-7 s here, draining
        and then sleeping 5 s for crash diagnostics once a child died first, and does nothing
        this server needs: its requests are answered or abandoned, its dumps are the caller's
        to clear (what it never published, the next start clears). What it made in /dev/shm
        goes with it (process_group.py says how)."""
        if self.process is None:
            return
        members = group_pids(self.process.pid)
        self.shm_files = sorted({*self.shm_files, *shm_files(members)})  # a start cut short too
        kill_group(self.process.pid, members)
        _wait_group_gone(self.process, 10.0)
        self.process.wait(timeout=5)
        self.process = None
        for path in self.shm_files:
            path.unlink(missing_ok=True)
        if self._log is not None:
            self._log.close()

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
