"""The throttling S3 endpoint (tools/throttling_proxy.py): a token bucket per prefix and kind of
request, S3's SlowDown answer above the rate, everything else passed on unchanged.
tests/integration/test_object_store.py puts it in front of the S3 server and a whole job."""

from __future__ import annotations

import http.server
import math
import threading
import time
from collections.abc import Iterator

import pytest
import requests

from tools.throttling_proxy import ThrottlingProxy, TokenBucket, prefix_of


class Upstream(http.server.ThreadingHTTPServer):
    """Answers every GET and PUT with 200 and the request's path, and records each."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str, bytes, str | None]] = []

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as S3 clients use it

            def _answer(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                server.seen.append((self.command, self.path, body, self.headers.get("Host")))
                out = self.path.encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(out)))
                self.send_header("ETag", '"e"')
                self.end_headers()
                self.wfile.write(out)

            do_GET = do_PUT = _answer

            def log_message(self, *args: object) -> None:
                pass

        server = self
        super().__init__(("127.0.0.1", 0), Handler)


@pytest.fixture
def upstream() -> Iterator[Upstream]:
    server = Upstream()
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.shutdown()


def test_a_bucket_refills_at_its_rate_up_to_its_burst() -> None:
    bucket = TokenBucket(rate=10, burst=3, stamp=0.0)
    assert [bucket.take(0.0) for _ in range(4)] == [True, True, True, False]
    assert not bucket.take(0.05)  # half a token
    assert bucket.take(0.1) and not bucket.take(0.1)
    assert [bucket.take(100.0) for _ in range(4)] == [True, True, True, False]  # burst at most


def test_a_prefix_is_the_bucket_and_the_first_key_segments() -> None:
    assert prefix_of("/hsx/run.zarr/aux_hidden_states/c/0/0/0", 1) == "hsx/run.zarr"
    assert (
        prefix_of("/hsx/run.zarr/aux_hidden_states/c/0/0/0", 2) == "hsx/run.zarr/aux_hidden_states"
    )
    assert prefix_of("/hsx", 1) == "hsx"


def test_writes_above_the_rate_get_slow_down_and_never_reach_the_server(
    upstream: Upstream,
) -> None:
    url = f"http://127.0.0.1:{upstream.server_address[1]}"
    with ThrottlingProxy(url, write_rate=4, retry_after_s=1) as proxy, requests.Session() as http:
        assert proxy.endpoint.startswith("http://127.0.0.1:")
        started = time.monotonic()
        answers = [http.put(f"{proxy.endpoint}/b/p/k{i}", data=b"x" * 10) for i in range(10)]
        refilled = math.floor(4 * (time.monotonic() - started))  # tokens back meanwhile
        # A burst of one second's worth passes, and what came back meanwhile.
        passed = [a for a in answers if a.status_code == 200]
        assert 4 <= len(passed) <= 4 + refilled < 10 and answers[:4] == passed[:4]
        slow = [a for a in answers if a.status_code != 200]
        assert {a.status_code for a in slow} == {503} and len(slow) == 10 - len(passed)
        assert "<Code>SlowDown</Code>" in slow[0].text and slow[0].headers["Retry-After"] == "1"
        assert proxy.throttled == {"PUT": len(slow)} and proxy.passed == {"PUT": len(passed)}
        # What passed reached the server as sent (its Host: a signature covers it); nothing else.
        host = proxy.endpoint.removeprefix("http://")
        assert upstream.seen == [("PUT", f"/b/p/k{i}", b"x" * 10, host) for i in range(len(passed))]
        assert passed[0].text == "/b/p/k0"
        # Another prefix has its own bucket; reads (no read_rate) are not throttled.
        assert http.put(f"{proxy.endpoint}/b/other/k", data=b"y").status_code == 200
        assert all(http.get(f"{proxy.endpoint}/b/p/k0").status_code == 200 for _ in range(10))
        time.sleep(0.3)  # a token back (one per 0.25 s)
        assert http.put(f"{proxy.endpoint}/b/p/again", data=b"z").status_code == 200


def test_reads_are_throttled_apart_from_writes(upstream: Upstream) -> None:
    url = f"http://127.0.0.1:{upstream.server_address[1]}"
    with ThrottlingProxy(url, read_rate=2) as proxy, requests.Session() as http:
        started = time.monotonic()
        codes = [http.get(f"{proxy.endpoint}/b/p/k").status_code for _ in range(5)]
        refilled = math.floor(2 * (time.monotonic() - started))
        assert codes[:2] == [200, 200] and 2 <= codes.count(200) <= 2 + refilled < 5
        assert "Retry-After" not in http.get(f"{proxy.endpoint}/b/p/k").headers  # S3 sends none
        assert all(
            http.put(f"{proxy.endpoint}/b/p/k", data=b"x").status_code == 200 for _ in range(5)
        )
