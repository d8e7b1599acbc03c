"""The fault campaign's parts: its seeded schedules, the proxy that fails, stalls, reads and
holds an endpoint's requests, and the filler that fills a file system (tools/fault_campaign.py
runs them on whole jobs)."""

from __future__ import annotations

import errno
import http.server
import itertools
import os
import re
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from tools.fault_campaign import FORMS, make_schedule
from tools.fault_injection import DiskFiller, FaultyProxy, RequestReader, socket_owner


@pytest.mark.parametrize("form", ["short", "full"])
def test_a_seed_gives_each_job_one_schedule_with_every_kind_spaced_out(form: str) -> None:
    for job in FORMS[form].jobs:
        schedule = make_schedule(3, job)
        assert schedule == make_schedule(3, job) != make_schedule(4, job)
        assert len(schedule) == job.faults and {f.kind for f in schedule} == set(job.kinds)
        times = [f.at_s for f in schedule]
        assert all(b - a >= 8 for a, b in itertools.pairwise(times))
        assert times[0] >= 15 and times[-1] < job.window_s
        parts = [f.after_parts for f in schedule]
        if job.generate is None:
            assert set(parts) == {0}
        else:  # spread over the generation, the last with parts still to generate after it
            assert parts[0] > 0 and all(a < b for a, b in itertools.pairwise(parts))
            assert parts[-1] < job.parts
    kinds = {job.name: set(job.kinds) for job in FORMS[form].jobs}
    assert {"kill_worker", "claim_kill", "kill_driver", "s3_reset", "s3_stall"} <= kinds["greedy"]
    assert kinds["greedy"] == kinds["sampled"]


PUTS: list[bytes] = []  # what the upstream below was sent, in order


@pytest.fixture
def upstream() -> Iterator[str]:
    class Hello(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive: requests follow each other on a connection

        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Length", "5")
            self.end_headers()
            self.wfile.write(b"hello")

        def do_PUT(self) -> None:
            PUTS.append(self.rfile.read(int(self.headers["Content-Length"])))
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    PUTS.clear()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Hello)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_the_proxy_passes_resets_and_stalls_as_told(upstream: str) -> None:
    with FaultyProxy(upstream) as proxy:
        assert proxy.endpoint.startswith("http://127.0.0.1:")
        assert requests.get(proxy.endpoint, timeout=5).text == "hello"
        proxy.mode = "reset"
        with pytest.raises(requests.ConnectionError):
            requests.get(proxy.endpoint, timeout=5)
        proxy.mode = "stall"
        with pytest.raises(requests.Timeout):
            requests.get(proxy.endpoint, timeout=0.5)
        proxy.mode = "pass"
        assert requests.get(proxy.endpoint, timeout=5).text == "hello"


def test_the_reader_splits_requests_by_their_length_and_keeps_watched_bodies() -> None:
    reader = RequestReader(re.compile(rb"/responses-"), 4321)
    one = b"PUT /b/s.zarr/generation/responses-00000001.json HTTP/1.1\r\nContent-Length: 7\r\n\r\n"
    two = b"PUT /b/s.zarr/c/0/0 HTTP/1.1\r\ncontent-length: 3\r\n\r\nabc"
    lines, done = reader.feed(one + b'{"a":')  # the body split over two reads
    assert lines == [one.split(b"\r\n")[0]] and done == []
    lines, done = reader.feed(b"1}" + two + b"GET /b/s.zarr/zarr.json HTTP/1.1\r\n\r\n")
    assert len(lines) == 2
    assert [(r.method, r.target, r.body, r.client_port) for r in done] == [
        ("PUT", "/b/s.zarr/generation/responses-00000001.json", b'{"a":1}', 4321),
        ("PUT", "/b/s.zarr/c/0/0", None, 4321),  # not watched: counted, not kept
        ("GET", "/b/s.zarr/zarr.json", None, 4321),
    ]
    chunked = RequestReader(None, 1)
    chunked.feed(b"PUT /x HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc")
    assert chunked.unread and chunked.feed(b"GET /y HTTP/1.1\r\n\r\n") == ([], [])


def test_the_proxy_logs_requests_and_holds_a_matching_one_past_its_clients_death(
    upstream: str,
) -> None:
    """A held upload goes on once let through, even when its client is gone: the write of a
    worker killed mid-claim that lands after its death."""
    with FaultyProxy(upstream, watch=rb"/responses-") as proxy:
        assert requests.put(proxy.endpoint + "/b/c/0", data=b"chunk", timeout=5).ok
        proxy.hold = re.compile(rb"^PUT \S*/responses-")
        client = socket.create_connection(("127.0.0.1", int(proxy.endpoint.rsplit(":", 1)[1])))
        client.sendall(
            b"PUT /b/generation/responses-00000002.json HTTP/1.1\r\nHost: x\r\n"
            b"Content-Length: 4\r\n\r\nmine"
        )
        deadline = time.monotonic() + 5
        while not proxy.held and time.monotonic() < deadline:
            time.sleep(0.02)
        assert proxy.held == [client.getsockname()[1]]
        assert socket_owner(proxy.held[0], [os.getpid()]) == os.getpid()
        assert socket_owner(proxy.held[0], [1]) is None
        client.close()  # the writer dies with its upload held
        time.sleep(0.3)
        assert PUTS == [b"chunk"], "a held request went on"
        assert requests.get(proxy.endpoint, timeout=5).text == "hello"  # the rest pass
        proxy.hold = None
        deadline = time.monotonic() + 5
        while len(PUTS) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert PUTS == [b"chunk", b"mine"]
    watched = [r for r in proxy.requests if r.body is not None]
    assert [(r.target, r.body) for r in watched] == [
        ("/b/generation/responses-00000002.json", b"mine")
    ]
    assert [r.method for r in proxy.requests] == ["PUT", "PUT", "GET"]


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    mount = ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(tmp_path)]
    if subprocess.run(mount, capture_output=True).returncode != 0:
        pytest.skip("mounting a tmpfs needs root")
    yield tmp_path
    subprocess.run(["umount", "-l", str(tmp_path)], check=False)


def test_the_filler_fills_the_file_system_until_released(small_tmpfs: Path) -> None:
    filler = DiskFiller(small_tmpfs)
    assert filler.fill() > 900_000
    with pytest.raises(OSError) as full:
        (small_tmpfs / "dump").write_bytes(b"x" * 8192)
    assert full.value.errno == errno.ENOSPC
    filler.release()
    (small_tmpfs / "dump").write_bytes(b"x" * 8192)
