"""A folder no process may write in, root included (the tests may run as root, whom a chmod
does not stop): `chattr +i`, undone when the test ends."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


@contextmanager
def locked_folder(path: Path) -> Iterator[Path]:
    path.mkdir()
    try:
        subprocess.run(["chattr", "+i", str(path)], check=True, capture_output=True)
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"chattr +i is not available here: {exc}")
    try:
        yield path
    finally:
        subprocess.run(["chattr", "-i", str(path)], check=True)
