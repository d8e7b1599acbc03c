"""The fault campaign's machine: a local multi-node Ray cluster on loopback, authenticated, in a
temp dir of its own; a small file system for the servers' dumps; and what of ours is in /dev/shm
and the temp dir (the campaign checks that nothing is left there). tools/fault_campaign.py uses
them.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from actors.private_folders import SHM_ROOT
from patches.settings import ENV_DUMP_DIR
from tools.fault_injection import DiskFiller
from tools.ray_head import private_temp_dir

DUMP_FS_BYTES = 256 << 20

# Every node on loopback, without a dashboard of its own.
ON_LOOPBACK: dict[str, Any] = {"node_ip_address": "127.0.0.1", "include_dashboard": False}
NODE_ARGS: dict[str, Any] = {"num_cpus": 1, "resources": {"sglang_node": 1}, **ON_LOOPBACK}


@dataclass
class DumpRoot:
    path: Path
    filler: DiskFiller | None


@contextlib.contextmanager
def dump_file_system(path: Path) -> Iterator[DumpRoot]:
    """A small tmpfs of the campaign's own for the servers' dumps (as root), so filling it
    touches nobody else; elsewhere a folder in /dev/shm, and no disk_full."""
    path.mkdir(mode=0o700, parents=True)
    mounted = (
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={DUMP_FS_BYTES},mode=0700", "tmpfs", str(path)],
            capture_output=True,
        ).returncode
        == 0
    )
    if mounted:
        try:
            yield DumpRoot(path, DiskFiller(path))
        finally:
            subprocess.run(["umount", "-l", str(path)], check=False)
        return
    shm = Path(tempfile.mkdtemp(prefix="hsx-campaign-", dir=SHM_ROOT))
    try:
        yield DumpRoot(shm, None)
    finally:
        subprocess.run(["rm", "-rf", str(shm)], check=False)


class _Cluster:
    """ray.cluster_utils.Cluster, authenticated (a token of its own), in a temp dir of its own."""

    def __init__(self, nodes: int, temp_dir: str) -> None:
        from ray.cluster_utils import Cluster

        self.temp_dir = temp_dir
        self.inner = Cluster()
        self.inner.add_node(num_cpus=1, temp_dir=temp_dir, **ON_LOOPBACK)  # planning, the driver
        for _ in range(nodes):
            self.inner.add_node(**NODE_ARGS, temp_dir=temp_dir)

    @property
    def address(self) -> str:
        return self.inner.address

    @property
    def worker_nodes(self) -> list[Any]:
        return list(self.inner.worker_nodes)

    def remove_node(self, node: Any, allow_graceful: bool) -> None:
        self.inner.remove_node(node, allow_graceful=allow_graceful)

    def add_node(self, **kwargs: Any) -> None:
        kwargs["temp_dir"] = self.temp_dir
        self.inner.add_node(**kwargs)


def configure_local_ray() -> None:
    """Before anything in this process configures Ray (it reads these once): the cluster
    authenticated (a token of its own), and on loopback (Ray turns a 127.0.0.1 address into the
    machine's own address unless told the cluster is this machine alone; its name for that,
    kept for laptops, is this variable). The driver and every node inherit both."""
    os.environ.update(
        RAY_AUTH_MODE="token",
        RAY_AUTH_TOKEN=secrets.token_hex(32),
        RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0",
    )


@contextlib.contextmanager
def ray_cluster(nodes: int) -> Iterator[_Cluster]:
    from ray._common.utils import get_ray_address_file

    # Cluster writes the head's address to Ray's default temp dir whatever temp_dir says, and
    # fails where that folder was never made (a machine that never ran Ray: /tmp/ray).
    Path(get_ray_address_file(None)).parent.mkdir(parents=True, exist_ok=True)
    with private_temp_dir() as temp_dir:
        cluster = _Cluster(nodes, temp_dir)
        try:
            yield cluster
        finally:
            cluster.inner.shutdown()


def our_shm_files() -> set[str]:
    marks = ("hsx-", "sglang_loads_", "sem.mp-")
    return {str(p) for p in SHM_ROOT.iterdir() if p.name.startswith(marks)}


def our_temp_entries() -> set[str]:
    return {str(p) for p in Path(tempfile.gettempdir()).glob("hsx-*")}


def our_processes(dump_root: Path) -> set[str]:
    """The live processes of servers that dump under `dump_root` (each of a server's processes
    has its dump folder in its environment): after a job, orphans its workers left."""
    mark = f"{ENV_DUMP_DIR}={dump_root}/".encode()
    found = set()
    for entry in Path("/proc").glob("[0-9]*"):
        with contextlib.suppress(OSError):  # gone meanwhile, or another user's
            stat = (entry / "stat").read_text()
            if stat.rsplit(")", 1)[1].split()[0] == "Z":
                continue  # dead, waiting to be reaped
            if any(v.startswith(mark) for v in (entry / "environ").read_bytes().split(b"\0")):
                command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()[:100]
                found.add(f"process {entry.name} ({command.strip()})")
    return found
