"""A server's output copied into its log file with its secrets masked.

SGLang logs its resolved arguments at startup, API keys included (only watermark keys are
redacted in 0.5.23), so the server never writes its log itself: its stdout and stderr are a pipe,
and a thread copies each line into a file only the worker's user can read, every secret replaced.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import IO

MASK = b"***"


class RedactedLog:
    def __init__(self, source: IO[bytes], path: Path, secrets: Iterable[str]) -> None:
        self._source = source
        self._secrets = [s.encode() for s in secrets if s]
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.fchmod(fd, 0o600)  # also when it was there before (a restarted server appends)
        self._log = os.fdopen(fd, "ab", buffering=0)
        self._thread = threading.Thread(target=self._copy, name="server-log", daemon=True)
        self._thread.start()

    def _copy(self) -> None:
        with self._log, self._source:
            for line in iter(self._source.readline, b""):
                for secret in self._secrets:
                    line = line.replace(secret, MASK)
                self._log.write(line)

    def close(self, timeout: float = 5.0) -> None:
        """Wait for the copy to reach the end of the output (the server has exited)."""
        self._thread.join(timeout)
