"""kill_group leaves no multiprocessing semaphore in /dev/shm, where a plain SIGKILL of the group
does (SGLang's processes hold such semaphores); shm_files finds the segments and semaphores a
group holds; the orphan sweep takes what no process holds, semaphores included."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from actors.private_folders import SHM_ROOT
from actors.process_group import (
    group_pids,
    kill_group,
    reclaim_orphan_segments,
    shm_files,
    young_orphan_segments,
)

# Like an SGLang server: spawn-started children sharing a named semaphore, and a mapped segment.
SERVER_LIKE = """
import mmap, multiprocessing as mp, sys, time
def child(lock):
    time.sleep(3600)
if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    lock = ctx.Lock()
    ctx.Process(target=child, args=(lock,)).start()
    with open(sys.argv[1], "r+b") as f:
        segment = mmap.mmap(f.fileno(), 0)
    print(lock._semlock.name, flush=True)
    time.sleep(3600)
"""

# A semaphore held by its maker alone, which maps it under the temporary name glibc made it with.
SEMAPHORE_MAKER = """
import multiprocessing as mp, time
lock = mp.get_context("spawn").Lock()
print(lock._semlock.name, flush=True)
time.sleep(3600)
"""


@pytest.fixture
def segment() -> Iterator[Path]:
    # Not `sglang_loads_*`: a worker on this machine (a job, the server tests) sweeps those.
    path = SHM_ROOT / f"test_segment_{uuid.uuid4().hex}.shm"
    path.write_bytes(b"\0" * 4096)
    yield path
    path.unlink(missing_ok=True)


def start_server_like(segment: Path) -> tuple[subprocess.Popen, Path]:
    process = subprocess.Popen(
        [sys.executable, "-c", SERVER_LIKE, str(segment)],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    assert process.stdout is not None
    semaphore = SHM_ROOT / f"sem.{process.stdout.readline().strip().lstrip('/')}"
    assert semaphore.exists()
    return process, semaphore


def wait_gone(process: subprocess.Popen) -> None:
    process.wait(10)
    deadline = time.monotonic() + 10
    while group_pids(process.pid):
        assert time.monotonic() < deadline, "the group outlived its kill"
        time.sleep(0.05)


def test_kill_group_lets_the_resource_tracker_remove_the_semaphores(segment: Path) -> None:
    process, semaphore = start_server_like(segment)
    try:
        assert len(group_pids(process.pid)) == 3  # itself, its child, the resource tracker
        assert shm_files(group_pids(process.pid)) == sorted([segment, semaphore])
        kill_group(process.pid)
        wait_gone(process)
        assert not semaphore.exists()
    finally:  # a failed check leaves nothing sleeping; the group gone, this does nothing
        kill_group(process.pid)


def test_a_plain_kill_of_the_group_leaks_them(segment: Path) -> None:
    """What kill_group is for: the same group SIGKILLed at once leaves the semaphore."""
    process, semaphore = start_server_like(segment)
    try:
        os.killpg(process.pid, signal.SIGKILL)
        wait_gone(process)
        assert semaphore.exists()
    finally:
        semaphore.unlink(missing_ok=True)


def test_orphan_segments_go_and_held_or_young_ones_stay() -> None:
    prefix = f"test_segment_{uuid.uuid4().hex[:8]}_"
    orphan, held, young = (SHM_ROOT / f"{prefix}{name}.shm" for name in ("orphan", "held", "young"))
    for path in (orphan, held, young):
        path.write_bytes(b"\0" * 4096)
    holder, semaphore = start_server_like(held)  # maps `held`, as a live server does
    try:
        old = time.time() - 60
        for path in (orphan, held):
            os.utime(path, (old, old))
        assert reclaim_orphan_segments(prefix) == [orphan]
        assert held.exists() and young.exists()
        # What a sweep that must leave nothing waits out: the young one no process holds.
        assert young_orphan_segments(prefix) == [young]
        os.utime(young, (old, old))
        assert young_orphan_segments(prefix) == [] and reclaim_orphan_segments(prefix) == [young]
    finally:
        kill_group(holder.pid)
        wait_gone(holder)
        for path in (orphan, held, young, semaphore):
            path.unlink(missing_ok=True)


def test_a_semaphore_is_held_by_its_maker_under_any_name_and_swept_once_orphaned() -> None:
    maker = subprocess.Popen(
        [sys.executable, "-c", SEMAPHORE_MAKER],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    assert maker.stdout is not None
    semaphore = SHM_ROOT / f"sem.{maker.stdout.readline().strip().lstrip('/')}"
    try:
        maps = Path(f"/proc/{maker.pid}/maps").read_text()
        assert str(semaphore) not in maps and "/dev/shm/sem." in maps  # another name, deleted
        old = time.time() - 60
        os.utime(semaphore, (old, old))
        assert shm_files(group_pids(maker.pid)) == [semaphore]  # by inode: under its name here
        assert reclaim_orphan_segments(semaphore.name) == []  # held: kept, however old
        os.killpg(maker.pid, signal.SIGKILL)  # its tracker too: the name leaks
        wait_gone(maker)
        assert semaphore.exists()
        assert reclaim_orphan_segments(semaphore.name) == [semaphore]
        assert not semaphore.exists()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(maker.pid, signal.SIGKILL)
        semaphore.unlink(missing_ok=True)
