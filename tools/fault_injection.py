"""Faults for the fault campaign (tools/fault_campaign.py): an object store that fails or stalls,
a file system that fills up, and the job's processes found by what they run.

    with FaultyProxy(s3.endpoint, watch=rb"/generation/") as proxy:   # the job: proxy.endpoint
        proxy.mode = "stall"                   # requests hang until "pass" again
        proxy.hold = re.compile(rb"^PUT ")     # requests whose line matches wait, the rest pass
        proxy.requests                         # every request seen; watched ones with their body
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import socket
import struct
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit

ProxyMode = Literal["pass", "stall", "reset"]


@dataclass(frozen=True)
class Request:
    """One HTTP request a client sent through the proxy (forwarded or not)."""

    at: float  # wall clock (time.time()) when its last byte came in
    method: str
    target: str  # the path and query, as sent
    body: bytes | None  # for a watched target; else None
    client_port: int  # the client's end of the connection (see `socket_owner`)


class RequestReader:
    """Splits what one client sends into HTTP/1.1 requests, by their Content-Length (S3 clients
    frame every body so). A body framed otherwise (chunked) ends the reading of the connection:
    `unread` says so, nothing is guessed."""

    def __init__(self, watch: re.Pattern[bytes] | None, client_port: int) -> None:
        self.watch, self.client_port = watch, client_port
        self.unread = False
        self._buffer = bytearray()
        self._head: tuple[str, str, bool] | None = None  # method, target, watched
        self._body_left = 0

    def feed(self, data: bytes) -> tuple[list[bytes], list[Request]]:
        """The request lines that begin in `data`, and the requests it completes."""
        lines: list[bytes] = []
        done: list[Request] = []
        if self.unread:
            return lines, done
        self._buffer += data
        while True:
            if self._head is None:
                end = self._buffer.find(b"\r\n\r\n")
                if end < 0:
                    return lines, done
                head = bytes(self._buffer[:end]).split(b"\r\n")
                del self._buffer[: end + 4]
                lines.append(head[0])
                method, target = [*head[0].split(b" "), b"", b""][:2]
                fields = dict(_header(line) for line in head[1:])
                if b"transfer-encoding" in fields:
                    self.unread = True
                    return lines, done
                watched = self.watch is not None and self.watch.search(target) is not None
                self._head = (method.decode(), target.decode(errors="replace"), watched)
                self._body_left = int(fields.get(b"content-length", b"0"))
            if len(self._buffer) < self._body_left:
                if not self._head[2]:  # an unwatched body is only counted, not kept
                    self._body_left -= len(self._buffer)
                    self._buffer.clear()
                return lines, done
            method, target, watched = self._head
            body = bytes(self._buffer[: self._body_left]) if watched else None
            del self._buffer[: self._body_left]
            done.append(Request(time.time(), method, target, body, self.client_port))
            self._head = None


def _header(line: bytes) -> tuple[bytes, bytes]:
    name, _, value = line.partition(b":")
    return name.strip().lower(), value.strip()


class FaultyProxy:
    """A TCP proxy on loopback in front of an HTTP endpoint (the S3 server). "pass" forwards,
    "stall" holds every byte in both directions (clients time out and retry), "reset" resets
    every connection, new and open, at its next byte (clients see connection errors).

    It also reads the requests it forwards: `requests` lists each (the bodies of those whose
    target matches `watch`), and while `hold` is set, a request whose request line matches it
    waits, whole, until `hold` is None again (then it goes on, even if its client is gone: a
    write in flight when its writer died); `held` lists the client ports of the requests held."""

    def __init__(self, upstream: str, watch: bytes | None = None) -> None:
        parts = urlsplit(upstream)
        self._upstream = (parts.hostname or "127.0.0.1", parts.port or 80)
        self.mode: ProxyMode = "pass"
        self.hold: re.Pattern[bytes] | None = None
        self.held: list[int] = []  # the client ports of the requests held
        self.requests: list[Request] = []
        self.unread = 0  # connections whose requests could not all be read (see RequestReader)
        self._watch = None if watch is None else re.compile(watch)
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
        requests = RequestReader(self._watch, writer.get_extra_info("peername")[1])
        await asyncio.gather(
            self._pipe(reader, up_writer, writer, requests),
            self._pipe(up_reader, writer, up_writer),
        )
        self.unread += requests.unread

    async def _pipe(
        self,
        source: asyncio.StreamReader,
        sink: asyncio.StreamWriter,
        other: asyncio.StreamWriter,
        requests: RequestReader | None = None,  # the client's side: its requests are read
    ) -> None:
        try:
            while data := await source.read(1 << 16):
                if requests is not None:
                    await self._read_requests(requests, data)
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

    async def _read_requests(self, requests: RequestReader, data: bytes) -> None:
        """Log the requests `data` completes; hold it while one it begins matches `hold`."""
        lines, done = requests.feed(data)
        self.requests += done
        hold = self.hold
        if hold is not None and any(hold.search(line) for line in lines):
            self.held.append(requests.client_port)
            while self.hold is not None:
                await asyncio.sleep(0.05)


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


def socket_owner(client_port: int, pids: list[int]) -> int | None:
    """Which of `pids` holds the loopback TCP socket whose own port is `client_port` (a client
    of the proxy), if one does: its inode from /proc/net/tcp, then the process's open files."""
    inodes = set()
    with open("/proc/net/tcp") as f:
        for line in f.readlines()[1:]:
            fields = line.split()
            if int(fields[1].rsplit(":", 1)[1], 16) == client_port:
                inodes.add(f"socket:[{fields[9]}]")
    for pid in pids:
        with contextlib.suppress(OSError):
            for fd in os.scandir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    if os.readlink(fd.path) in inodes:
                        return pid
    return None
