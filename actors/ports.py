"""A free TCP port for a process that binds it only later.

`bind(0)` hands out a port from the kernel's ephemeral range, the same range every outgoing
connection draws its local port from. A server that binds its port seconds after we picked it (an
SGLang server loads weights and tokenizer first) can find it taken by one of those connections:
seen in CI, where a `--dp-size 2` server lost its HTTP port 20 s after the pick. So we pick below
the ephemeral range, where only explicit binds land (SGLang picks its NCCL port the same way).
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

LOWEST = 20000  # above Ray's worker ports (10002-19999 by default)
ATTEMPTS = 64


def ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now, below the ephemeral range when it leaves room."""
    candidates = range(LOWEST, ephemeral_low())
    for port in random.sample(candidates, min(ATTEMPTS, len(candidates))):
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # a machine whose ephemeral range starts low: take the kernel's
        s.bind((host, 0))
        return s.getsockname()[1]
