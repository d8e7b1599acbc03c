"""The fault campaign's parts: its seeded schedule, the proxy that fails or stalls an endpoint,
and the filler that fills a file system (tools/fault_campaign.py runs them on a whole job)."""

from __future__ import annotations

import errno
import http.server
import itertools
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from tools.fault_campaign import FORMS, KINDS, make_schedule
from tools.fault_injection import DiskFiller, FaultyProxy


def test_a_seed_gives_one_schedule_with_every_kind_spaced_out() -> None:
    form = FORMS["short"]
    schedule = make_schedule(3, form)
    assert schedule == make_schedule(3, form) != make_schedule(4, form)
    assert len(schedule) == form.faults and {f.kind for f in schedule} == set(KINDS)
    times = [f.at_s for f in schedule]
    assert all(b - a >= 8 for a, b in itertools.pairwise(times))
    assert times[0] >= 15 and times[-1] < form.window_s
    full = make_schedule(3, FORMS["full"])
    assert len(full) == FORMS["full"].faults and {f.kind for f in full} == set(KINDS)


@pytest.fixture
def upstream() -> Iterator[str]:
    class Hello(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Length", "5")
            self.end_headers()
            self.wfile.write(b"hello")

        def log_message(self, *args: object) -> None:
            pass

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
