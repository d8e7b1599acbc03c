"""A server's process group as /proc shows it: its members, the /dev/shm files they hold, and a
kill that leaves nothing in /dev/shm.

SGLang starts its scheduler and detokenizer with multiprocessing's spawn, which names its
semaphores in /dev/shm (`sem.mp-*`) and leaves their removal to a resource-tracker process at
exit. A SIGKILL of the whole group kills the tracker with them and leaks the names (measured: one
per server start). kill_group kills every member but the tracker first: the tracker sees its
clients gone, removes what they left and exits (0.14 s here), and then the rest is killed.

A file is held when a process has it open or mapped, matched by inode: glibc makes a semaphore
under a temporary name, maps it, then links it as `sem.mp-*`, so its maker's mappings show the
temporary name (deleted), never the one in /dev/shm.
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
SEMAPHORES = "sem.mp-"  # multiprocessing's named semaphores (a spawn context's)
# What a killed server can leave: its load snapshot; semaphores, where its tracker died first
# (SGLang's own SIGTERM handling kills its children, the tracker among them).
ORPHAN_PREFIXES = (SGLANG_SEGMENTS, SEMAPHORES)


def group_pids(pgid: int) -> list[int]:
    pids = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            with contextlib.suppress(OSError):  # gone meanwhile
                if os.getpgid(int(entry.name)) == pgid:
                    pids.append(int(entry.name))
    return pids


def shm_files(pids: list[int]) -> list[Path]:
    """The files directly in /dev/shm that these processes have open or mapped, by their names
    there (SGLang's load-snapshot segment, named at random per start; the semaphores its
    processes share)."""
    held = _held_inodes(pids)
    return sorted(path for path, inode, _ in _shm_entries() if inode in held)


def reclaim_orphan_segments(
    prefix: str | tuple[str, ...] = ORPHAN_PREFIXES, grace_s: float = 5.0
) -> list[Path]:
    """Remove the files `/dev/shm/<prefix>*` that no process holds (open or mapped) and that
    are older than `grace_s`: SGLang's load-snapshot segments, named at random per server start,
    which SGLang never removes once a server is killed (by SIGTERM either), and which a worker
    killed while its server started could not list (actors/private_folders.py); semaphores whose
    tracker died before it removed them. A live server holds its segment and semaphores from the
    moment it makes them."""
    candidates = [(path, inode) for path, inode, age in _shm_entries(prefix) if age > grace_s]
    if not candidates:
        return []
    held = _held_inodes(_all_pids())
    removed = []
    for path, inode in candidates:
        if inode not in held:
            with contextlib.suppress(OSError):  # gone meanwhile, or another user's
                path.unlink()
                removed.append(path)
    return removed


def young_orphan_segments(
    prefix: str | tuple[str, ...] = ORPHAN_PREFIXES, grace_s: float = 5.0
) -> list[Path]:
    """The files `/dev/shm/<prefix>*` that no process holds but that are too young for
    reclaim_orphan_segments to remove yet: a server killed as it started leaves one, and a
    sweep that must leave none waits them out."""
    young = [(path, inode) for path, inode, age in _shm_entries(prefix) if age <= grace_s]
    if not young:
        return []
    held = _held_inodes(_all_pids())
    return [path for path, inode in young if inode not in held]


def _shm_entries(prefix: str | tuple[str, ...] = "") -> list[tuple[Path, int, float]]:
    """The files directly in /dev/shm named `<prefix>*`, each with its inode and its age
    (seconds since last modified)."""
    now, found = time.time(), []
    for entry in os.scandir(SHM_ROOT):
        with contextlib.suppress(OSError):  # gone meanwhile
            if entry.name.startswith(prefix) and entry.is_file(follow_symlinks=False):
                st = entry.stat(follow_symlinks=False)
                found.append((Path(entry.path), st.st_ino, now - st.st_mtime))
    return found


def _held_inodes(pids: list[int]) -> set[int]:
    """The inodes of the /dev/shm files these processes have open (a descriptor) or mapped."""
    shm_dev = os.stat(SHM_ROOT).st_dev
    held: set[int] = set()
    for pid in pids:
        with contextlib.suppress(OSError):  # gone meanwhile, or not ours to read
            for fd in os.scandir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    if os.readlink(fd.path).startswith(f"{SHM_ROOT}/"):  # stat nothing else
                        st = os.stat(fd.path)  # the open file, whatever its name now
                        if st.st_dev == shm_dev:
                            held.add(st.st_ino)
            with open(f"/proc/{pid}/maps") as maps:
                for line in maps:  # address perms offset dev inode [path]
                    fields = line.split(maxsplit=5)
                    if len(fields) == 6 and fields[5].startswith(f"{SHM_ROOT}/"):
                        major, minor = (int(x, 16) for x in fields[3].split(":"))
                        if os.makedev(major, minor) == shm_dev:
                            held.add(int(fields[4]))
    return held


def _all_pids() -> list[int]:
    return [int(e.name) for e in os.scandir("/proc") if e.name.isdigit()]


def kill_group(
    pgid: int,
    members: list[int] | None = None,
    tracker_timeout: float = 2.0,
    spare: int | None = None,
) -> None:
    """SIGKILL the group (`members`: its pids, if known), its resource trackers last (they clean
    up once their clients die). `spare`: the one member left alive (a group's supervisor that
    ends it from inside and exits on its own)."""
    members = [pid for pid in (group_pids(pgid) if members is None else members) if pid != spare]
    trackers = [pid for pid in members if _is_tracker(pid)]
    for pid in members:
        if pid not in trackers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + tracker_timeout
    while any(_running(pid) for pid in trackers) and time.monotonic() < deadline:
        time.sleep(0.02)
    if spare is None:
        with contextlib.suppress(ProcessLookupError):  # gone already
            os.killpg(pgid, signal.SIGKILL)
        return
    for pid in group_pids(pgid):  # what appeared meanwhile
        if pid != spare:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


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
