"""A held folder survives every reclaim while its holder lives, and goes (with the /dev/shm files
it lists) once its holder is killed outright."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from actors.private_folders import SHM_ROOT, HeldFolder, reclaim_abandoned

HOLDER = """
import sys
from pathlib import Path
from actors.private_folders import HeldFolder
held = HeldFolder.claim(Path(sys.argv[1]), "hsx-dumps-")
(held.path / "req_0.safetensors").write_bytes(b"x" * 1000)
held.list_shm_files([Path(sys.argv[2])])
print(held.path, flush=True)
sys.stdin.read()  # until killed
"""


@pytest.fixture
def shm_file() -> Path:
    # Not `sglang_loads_*`: a worker on this machine (a job, the server tests) sweeps those.
    path = SHM_ROOT / f"test_segment_{uuid.uuid4().hex}.shm"
    path.write_bytes(b"segment")
    yield path
    path.unlink(missing_ok=True)


def test_a_live_holders_folder_is_kept_and_a_killed_ones_is_removed_with_its_shm_files(
    tmp_path: Path, shm_file: Path
) -> None:
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(tmp_path), str(shm_file)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout is not None
    folder = Path(holder.stdout.readline().strip())
    assert oct(folder.stat().st_mode & 0o777) == "0o700"
    assert reclaim_abandoned(tmp_path, "hsx-dumps-") == []  # alive: untouched
    assert (folder / "req_0.safetensors").exists() and shm_file.exists()

    holder.kill()  # SIGKILL: no cleanup of its own runs
    holder.wait(10)
    assert reclaim_abandoned(tmp_path, "hsx-other-") == []  # another prefix: not ours to judge
    assert reclaim_abandoned(tmp_path, "hsx-dumps-") == [folder]
    assert list(tmp_path.iterdir()) == [] and not shm_file.exists()


def test_a_folder_released_by_its_holder_goes_or_stays_as_asked(tmp_path: Path) -> None:
    gone, kept = HeldFolder.claim(tmp_path, "a-"), HeldFolder.claim(tmp_path, "b-")
    assert gone.path.name.startswith("a-") and kept.path.name.startswith("b-")
    gone.release()
    kept.release(remove=False)
    assert not gone.path.exists() and kept.path.exists()


def test_an_abandoned_folder_is_kept_until_unchanged_for_keep_s(tmp_path: Path) -> None:
    log = HeldFolder.claim(tmp_path, "hsx-worker-")
    (log.path / "server.log").write_text("why it failed")
    log.release(remove=False)  # a failed worker keeps its log
    assert reclaim_abandoned(tmp_path, "hsx-worker-", keep_s=3600) == []
    old = time.time() - 7200
    for path in (log.path / "server.log", log.path):
        os.utime(path, (old, old))
    assert reclaim_abandoned(tmp_path, "hsx-worker-", keep_s=3600) == [log.path]


def test_a_staging_folder_is_left_to_its_claimer_for_a_grace(tmp_path: Path) -> None:
    """One a claimer made but has not locked yet (or died before locking) is not judged young."""
    staging = tmp_path / ".hsx-dumps-x"
    staging.mkdir()
    assert reclaim_abandoned(tmp_path, "hsx-dumps-") == []
    old = time.time() - 3600
    os.utime(staging, (old, old))
    assert reclaim_abandoned(tmp_path, "hsx-dumps-") == [staging]


def test_a_listed_file_outside_dev_shm_is_never_removed(tmp_path: Path) -> None:
    elsewhere = tmp_path / "keep.txt"
    elsewhere.write_text("not a segment")
    held = HeldFolder.claim(tmp_path / "root", "hsx-dumps-")
    held.list_shm_files([elsewhere, SHM_ROOT / "sub" / "x"])
    held.release()
    assert elsewhere.exists() and not held.path.exists()
