"""A server's process group as /proc shows it: its members, the /dev/shm files they hold, and a
kill that leaves nothing in /dev/shm.

SGLang starts its scheduler and detokenizer with multiprocessing's spawn, which names its
semaphores in /dev/shm (`sem.mp-*`) and leaves their removal to a resource-tracker process at
exit. A SIGKILL of the whole group kills the tracker with them and leaks the names (measured: one
per server start). kill_group kills every member but the tracker first: the tracker sees its
clients gone, removes what they left and exits (0.14 s here), and then the rest is killed.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

from actors.private_folders import SHM_ROOT

TRACKER_MARK = b"multiprocessing.resource_tracker"  # in the tracker's command line
SGLANG_SEGMENTS = "sglang_loads_"  # managers/load_snapshot.py: shm_path_for()


def group_pids(pgid: int) -> list[int]:
    pids = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            with contextlib.suppress(OSError):  # gone meanwhile
                if os.getpgid(int(entry.name)) == pgid:
                    pids.append(int(entry.name))
    return pids


def shm_files(pids: list[int]) -> list[Path]:
    """The files directly in /dev/shm that these processes have open or mapped (SGLang's
    load-snapshot segment, named at random per start)."""
    found: set[Path] = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            for fd in os.scandir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    found.add(Path(os.readlink(fd.path)))
            with open(f"/proc/{pid}/maps") as maps:
                found.update(Path(line.split(maxsplit=5)[-1].strip()) for line in maps)
    return sorted(p for p in found if p.parent == SHM_ROOT and p.exists())


def reclaim_orphan_segments(prefix: str = SGLANG_SEGMENTS, grace_s: float = 5.0) -> list[Path]:
    """Remove the files `/dev/shm/<prefix>*` that no process holds (open or mapped) and that
    are older than `grace_s`: SGLang's load-snapshot segments, named at random per server start,
    which SGLang never removes once a server is killed (by SIGTERM either), and which a worker
    killed while its server started could not list (actors/private_folders.py). A live server
    holds its segment from the moment it makes it."""
    candidates = [path for path, age in _segments(prefix) if age > grace_s]
    if not candidates:
        return []
    held = _held_files()
    removed = []
    for path in candidates:
        if path not in held:
            with contextlib.suppress(OSError):  # gone meanwhile, or another user's
                path.unlink()
                removed.append(path)
    return removed


def young_orphan_segments(prefix: str = SGLANG_SEGMENTS, grace_s: float = 5.0) -> list[Path]:
    """The files `/dev/shm/<prefix>*` that no process holds but that are too young for
    reclaim_orphan_segments to remove yet: a server killed as it started leaves one, and a
    sweep that must leave none waits them out."""
    young = [path for path, age in _segments(prefix) if age <= grace_s]
    if not young:
        return []
    held = _held_files()
    return [path for path in young if path not in held]


def _segments(prefix: str) -> list[tuple[Path, float]]:
    """The files `/dev/shm/<prefix>*`, each with its age (seconds since last modified)."""
    now, found = time.time(), []
    for entry in os.scandir(SHM_ROOT):
        with contextlib.suppress(OSError):
            if entry.name.startswith(prefix):
                found.append((Path(entry.path), now - entry.stat().st_mtime))
    return found


def _held_files() -> set[Path]:
    return set(shm_files([int(e.name) for e in os.scandir("/proc") if e.name.isdigit()]))


def kill_group(pgid: int, members: list[int] | None = None, tracker_timeout: float = 2.0) -> None:
    """SIGKILL the group (`members`: its pids, if known), its resource trackers last (they clean
    up once their clients die)."""
    members = group_pids(pgid) if members is None else members
    trackers = [pid for pid in members if _is_tracker(pid)]
    for pid in members:
        if pid not in trackers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + tracker_timeout
    while any(_running(pid) for pid in trackers) and time.monotonic() < deadline:
        time.sleep(0.02)
    with contextlib.suppress(ProcessLookupError):  # gone already
        os.killpg(pgid, signal.SIGKILL)


def _is_tracker(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return TRACKER_MARK in f.read()
    except OSError:
        return False


def _running(pid: int) -> bool:
    """Alive and not a zombie (a tracker is the server's child: it stays a zombie until reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
