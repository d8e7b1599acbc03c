"""Private folders a process holds on its node, and reclaiming those their holders left behind.

    dumps = HeldFolder.claim(Path("/dev/shm"), "hsx-dumps-w1-")  # 0700, locked while we live
    reclaim_abandoned(Path("/dev/shm"), "hsx-dumps-")            # what dead holders left

A worker killed by SIGKILL (`ray.kill` of a straggler, an OOM kill) runs no cleanup, and its dump
folder in /dev/shm holds RAM until the machine reboots. So every folder is held by an exclusive
flock on the folder itself, and the kernel drops that lock when its holder dies, however it dies:
a folder whose lock can be taken has no live holder, and the next process on the node that claims
a folder removes it. A live holder's folder is never touched: it is born locked (made under a
hidden name, locked, then renamed into view), and removed only under the lock.

A holder may list, in the folder's `SHM_LIST`, files it made elsewhere in /dev/shm (its SGLang
server's segments, which SGLang names at random and never removes after a kill): they are removed
with the folder.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

SHM_ROOT = Path("/dev/shm")
SHM_LIST = "shm-files.txt"  # in a held folder: /dev/shm files to remove with it, one per line
STAGING_GRACE_S = 60.0  # a hidden (staging) folder is locked a moment after it is made


@dataclass
class HeldFolder:
    path: Path
    _fd: int

    @classmethod
    def claim(cls, root: Path, prefix: str) -> HeldFolder:
        """A new private folder `root/<prefix><random>`, locked for as long as this process
        lives (or until release())."""
        root.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{prefix}", dir=root))  # 0700
        fd = os.open(staging, os.O_RDONLY | os.O_DIRECTORY)  # not inherited (O_CLOEXEC)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # nobody else knows it yet
        path = root / staging.name[1:]
        staging.rename(path)  # the lock stays with the inode
        return cls(path, fd)

    def list_shm_files(self, paths: list[Path]) -> None:
        """Record /dev/shm files to remove with this folder should this process die first."""
        # 0600 like every file we write in /dev/shm, whatever the umask
        fd = os.open(self.path / SHM_LIST, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        with os.fdopen(fd, "a") as f:
            f.writelines(f"{p}\n" for p in paths)

    def release(self, remove: bool = True) -> None:
        """Remove the folder (and the files it lists) and drop the lock; `remove=False` keeps
        the folder for a later reclaim to judge by its age."""
        if self._fd < 0:
            return
        if remove:
            _remove(self.path)
        os.close(self._fd)
        self._fd = -1


def reclaim_abandoned(root: Path, prefix: str, keep_s: float = 0.0) -> list[Path]:
    """Remove every folder `root/<prefix>*` whose holder is gone and that nothing has changed
    for `keep_s` seconds (logs are kept a while; dumps are not); the folders removed."""
    removed = []
    with contextlib.suppress(FileNotFoundError):
        for entry in os.scandir(root):
            staging = entry.name.startswith(f".{prefix}")
            if not (entry.name.startswith(prefix) or staging):
                continue
            grace = max(keep_s, STAGING_GRACE_S) if staging else keep_s
            if _reclaim(Path(entry.path), grace):
                removed.append(Path(entry.path))
    if removed:
        logger.info("removed %d folder(s) that dead processes left: %s", len(removed), removed)
    return removed


def _reclaim(path: Path, keep_s: float) -> bool:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:  # gone, not a folder, or another user's
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return False  # its holder lives
    try:
        if keep_s > 0 and time.time() - _last_change(path) < keep_s:
            return False
        _remove(path)
        return True
    finally:
        os.close(fd)


def _last_change(path: Path) -> float:
    times = [path.stat().st_mtime]
    for entry in path.rglob("*"):
        with contextlib.suppress(OSError):
            times.append(entry.stat().st_mtime)
    return max(times)


def _remove(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        for line in (path / SHM_LIST).read_text().splitlines():
            listed = Path(line)
            if listed.parent == SHM_ROOT:  # what we wrote; nothing outside /dev/shm's top
                listed.unlink(missing_ok=True)
    shutil.rmtree(path, ignore_errors=True)
