"""An export's files on disk: each written under a temporary name in its own directory
(`.<name>.tmp-<pid>-<hex>`, which neither trainer's file scan matches), fsynced and
`os.replace`d, so an interrupted export leaves whole files only; the temporaries of an
interrupted run removed by the next; one export at a time per directory."""

from __future__ import annotations

import contextlib
import fcntl
import os
import secrets
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

from hsx_store.export.base import ExportError

LOCK_NAME = ".export.lock"
TMP_MARK = ".tmp-"  # temporaries are ".<final name>.tmp-<pid>-<hex>"


def tmp_name(path: Path) -> Path:
    return path.parent / f".{path.name}{TMP_MARK}{os.getpid()}-{secrets.token_hex(4)}"


def write_atomic(path: Path, write: Callable[[IO[bytes]], Any]) -> int:
    """Write under a temporary name in the same directory, fsync, rename: the final name only
    ever holds a whole file. Returns the bytes written."""
    tmp = tmp_name(path)
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
            size = f.tell()
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return size


def remove_temporaries(out: Path) -> int:
    """Temporaries of interrupted runs (this run holds the lock: none is anyone's live file)."""
    removed = 0
    for root, dirs, files in os.walk(out):
        for name in [d for d in dirs if d.startswith(".") and TMP_MARK in d]:
            shutil.rmtree(Path(root) / name, ignore_errors=True)
            dirs.remove(name)
            removed += 1
        for name in files:
            if name.startswith(".") and TMP_MARK in name:
                (Path(root) / name).unlink(missing_ok=True)
                removed += 1
    return removed


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def exclusive(out: Path) -> Iterator[None]:
    """One export at a time per directory (a second one would delete the first's temporaries)."""
    with open(out / LOCK_NAME, "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ExportError(f"another export is writing into {out}") from None
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
