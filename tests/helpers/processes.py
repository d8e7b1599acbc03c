"""Processes in tests: is a process group still there, and a starter killed outright."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def kill_and_wait(
    starter: subprocess.Popen, alive: Callable[[], bool], timeout: float, what: str
) -> None:
    """SIGKILL the starter (no cleanup of its own runs) and wait until `alive()` is false."""
    starter.send_signal(signal.SIGKILL)
    starter.wait(timeout=10)
    deadline = time.monotonic() + timeout
    while alive():
        assert time.monotonic() < deadline, f"{what} outlived its starter"
        time.sleep(0.05)
