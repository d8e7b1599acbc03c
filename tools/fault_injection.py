"""Faults for the fault campaign (tools/fault_campaign.py): an object store that fails or stalls,
a file system that fills up, and the job's processes found by what they run.

    with FaultyProxy(s3.endpoint) as proxy:   # the job talks to proxy.endpoint
        proxy.mode = "stall"                   # requests hang until "pass" again
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import struct
import threading
from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit

ProxyMode = Literal["pass", "stall", "reset"]


class FaultyProxy:
    """A TCP proxy on loopback in front of an HTTP endpoint (the S3 server). "pass" forwards,
    "stall" holds every byte in both directions (clients time out and retry), "reset" resets
    every connection, new and open, at its next byte (clients see connection errors)."""

    def __init__(self, upstream: str) -> None:
        parts = urlsplit(upstream)
        self._upstream = (parts.hostname or "127.0.0.1", parts.port or 80)
        self.mode: ProxyMode = "pass"
        self._loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="faulty-proxy", daemon=True)
        self.endpoint = ""

    def __enter__(self) -> FaultyProxy:
        self._thread.start()
        self._started.wait(10)
        return self

    def __exit__(self, *exc: object) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        server = self._loop.run_until_complete(
            asyncio.start_server(self._connection, "127.0.0.1", 0)
        )
        port = server.sockets[0].getsockname()[1]
        self.endpoint = f"http://127.0.0.1:{port}"
        self._started.set()
        self._loop.run_forever()
        server.close()
        pending = asyncio.all_tasks(self._loop)  # connections still open (stalled ones too)
        for task in pending:
            task.cancel()
        self._loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        self._loop.close()

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.mode == "reset":
            _reset(writer)
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(*self._upstream)
        except OSError:
            _reset(writer)
            return
        await asyncio.gather(
            self._pipe(reader, up_writer, writer), self._pipe(up_reader, writer, up_writer)
        )

    async def _pipe(
        self, source: asyncio.StreamReader, sink: asyncio.StreamWriter, other: asyncio.StreamWriter
    ) -> None:
        try:
            while data := await source.read(1 << 16):
                while self.mode == "stall":
                    await asyncio.sleep(0.05)
                if self.mode == "reset":
                    break
                sink.write(data)
                await sink.drain()
        except OSError:
            pass
        finally:
            for w in (sink, other):
                _reset(w) if self.mode == "reset" else w.close()


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close with a TCP RST (SO_LINGER 0), as a crashed or overloaded server's host does."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.close()


class DiskFiller:
    """Fills the file system holding `folder` (a small tmpfs) for a while; `release()` frees it."""

    def __init__(self, folder: Path) -> None:
        self.path = folder / ".campaign-filler"

    def fill(self) -> int:
        """Take every free byte; the bytes taken."""
        before = _free_bytes(self.path.parent)
        with open(self.path, "wb") as f:
            with contextlib.suppress(OSError):  # ENOSPC: full
                os.posix_fallocate(f.fileno(), 0, before)
            f.seek(0, os.SEEK_END)
            block = b"\0" * (1 << 16)
            with contextlib.suppress(OSError):
                while True:  # what fallocate left, to the last block
                    f.write(block)
                    f.flush()
        return before - _free_bytes(self.path.parent)

    def release(self) -> None:
        self.path.unlink(missing_ok=True)


def _free_bytes(folder: Path) -> int:
    stat = os.statvfs(folder)
    return stat.f_bavail * stat.f_frsize


def processes(mark: bytes) -> list[int]:
    """Pids whose command line holds `mark`, ascending (Ray names an actor's process after it:
    `ray::NodeWorker.run`)."""
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                with open(f"/proc/{entry.name}/cmdline", "rb") as f:
                    if mark in f.read():
                        found.append(int(entry.name))
            except OSError:
                continue
    return sorted(found)


def server_groups(model_path: Path) -> list[int]:
    """Process groups of the SGLang servers serving `model_path` (each leads its own)."""
    leaders = []
    for pid in processes(b"sglang.launch_server"):
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            serves = str(model_path).encode() in f.read()
        with contextlib.suppress(ProcessLookupError):
            if serves and os.getpgid(pid) == pid:
                leaders.append(pid)
    return leaders
