"""Every file a worker leaves in its folders (its list of /dev/shm files, its servers' dumps, a
deferred lease's spill, its server's log) is 0600 and every folder 0700, whatever the umask
of the process that writes it: the dump writer runs in the SGLang server (umask 077), but the
rule must not hang on that."""

from __future__ import annotations

import io
import os
import shutil
import stat
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from actors.private_folders import SHM_LIST, SHM_ROOT, HeldFolder
from actors.server_log import RedactedLog
from actors.shard_writer import ShardWriter
from patches import host_regions
from patches.dump_writer import DumpWriter
from tests.helpers.synthetic import as_input, new_store, sample_bits


@pytest.fixture
def dump_root(tmp_path: Path) -> Iterator[Path]:
    """Where a worker's dump folder lives: /dev/shm (a tmpfs: the ring writer's too)."""
    if not SHM_ROOT.is_dir():
        yield tmp_path / "shm"
        return
    root = Path(tempfile.mkdtemp(dir=SHM_ROOT, prefix="test_private_files-"))
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def everyday_umask() -> Iterator[None]:
    """The usual umask, under which a file made without a mode is 0644."""
    old = os.umask(0o022)
    yield
    os.umask(old)


def test_every_file_a_worker_leaves_in_its_folders_is_private(
    dump_root: Path, tmp_path: Path, everyday_umask: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(host_regions, "cuda_register", lambda ptr, n: True)  # the ring on CPU
    monkeypatch.setattr(host_regions, "cuda_unregister", lambda ptr: None)
    dumps = HeldFolder.claim(dump_root, "hsx-dumps-w1-")
    logs = HeldFolder.claim(tmp_path / "logs", "hsx-worker-w1-")
    dumps.list_shm_files([SHM_ROOT / "sglang_a.shm"])
    dumps.list_shm_files([SHM_ROOT / "sglang_b.shm"])  # a restarted server's: appended
    # A server start's dumps each: through the preallocated pool and through the ring.
    writers = [
        DumpWriter(dumps.path / f"server-{n}", device="cpu", ring=ring)
        for n, ring in enumerate((False, True))
    ]
    for writer in writers:
        dump = writer.open("req_0", {"h": ((4, 8), torch.bfloat16)}, {"rid": "r"})
        dump.fill("h", 0, torch.ones(4, 8, dtype=torch.bfloat16))
        dump.publish()
        writer.flush(timeout=30)
    store = new_store(tmp_path / "s.zarr")
    shard = store.shards[1]
    spill = dumps.path / "spill-1"
    spiller = ShardWriter(store, shard, threads=1, spill_dir=spill)
    log = RedactedLog(io.BytesIO(b"api_key=k-secret\n"), logs.path / "server-0.log", ["k-secret"])
    try:
        for i in range(shard.sample_begin, shard.sample_end):
            spiller.write_sample(i, *(as_input(x, i) for x in sample_bits(i)))
        deadline = time.monotonic() + 10
        while not list(spill.glob("*.bin")):
            assert time.monotonic() < deadline, "nothing spilled"
            time.sleep(0.01)
        log.close()
        written = [p for folder in (dumps.path, logs.path) for p in (folder, *folder.rglob("*"))]
        names = {p.name for p in written}
        assert {SHM_LIST, "meta.json", "tensors.safetensors", "server-0.log"} <= names, names
        assert any(p.parent.name == ".ring" for p in written), "the ring writer holds no region"
        assert any(p.suffix == ".bin" for p in written), "no spill file listed"
        for path in written:
            try:
                mode = stat.S_IMODE(path.lstat().st_mode)
            except FileNotFoundError:  # a spill file's temporary, renamed by its writer thread
                assert path.suffix == ".partial", f"{path} vanished"
                continue
            assert mode == (0o700 if path.is_dir() else 0o600), f"{path}: {oct(mode)}"
    finally:
        spiller.abort()
        for writer in writers:
            writer.close(timeout=30)
        dumps.release()
        logs.release()
