"""An S3 endpoint on loopback that throttles as S3 does: in front of an S3 server (moto), it
answers `503 SlowDown` (S3's error, its XML body and all) to the requests above a set rate,
each prefix with its own token bucket, writes (PUT, POST, DELETE) and reads (GET, HEAD) apart,
as S3 counts them (3,500 and 5,500 requests/s per prefix); the rest go to the server unchanged
(their signatures name this endpoint's host, and the server checks them).

    with ThrottlingProxy(s3.endpoint, write_rate=20) as proxy:   # the job talks to proxy.endpoint
        ...
    proxy.throttled["PUT"], proxy.passed["PUT"]                   # what it answered
    proxy.write_rate_while_throttling()                           # how busy it was kept
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import Literal

import aiohttp
import yarl
from aiohttp import web

RequestKind = Literal["write", "read"]
WRITES = {"PUT", "POST", "DELETE"}
# Not forwarded as they came: they describe one hop (RFC 9110 7.6.1), or the body aiohttp
# re-frames (it sets Content-Length itself).
HOP_HEADERS = {
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "content-length",
}
SLOW_DOWN = (
    '<?xml version="1.0" encoding="UTF-8"?>\n'
    "<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message>"
    "<RequestId>{request_id}</RequestId><HostId>{request_id}</HostId></Error>"
)


@dataclass
class TokenBucket:
    """`rate` tokens a second, holding at most `burst`; a request takes one or is refused."""

    rate: float
    burst: float
    tokens: float = field(init=False)
    stamp: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        self.tokens = self.burst

    def take(self, now: float) -> bool:
        self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        if self.tokens >= 1:
            self.tokens -= 1
            return True
        return False


def prefix_of(path: str, depth: int) -> str:
    """The bucket and the key's first `depth` path segments: what shares one token bucket
    (path-style URLs: /bucket/key)."""
    return "/".join(path.lstrip("/").split("/")[: depth + 1])


class ThrottlingProxy:
    """`write_rate`/`read_rate`: requests a second per prefix (None: unlimited), with a burst of
    `burst_s` seconds' worth; `prefix_depth` key segments name a prefix (1: `bucket/run.zarr`,
    a store); `retry_after_s`: sent with each SlowDown when set (S3 itself sends none).
    `passed`/`throttled` count requests by method, `sent` the body bytes of those passed;
    `writes` holds each write's (time, passed)."""

    def __init__(
        self,
        upstream: str,
        *,
        write_rate: float | None = None,
        read_rate: float | None = None,
        burst_s: float = 1.0,
        prefix_depth: int = 1,
        retry_after_s: int | None = None,
    ) -> None:
        self._upstream = upstream.rstrip("/")
        self._rates: dict[RequestKind, float | None] = {"write": write_rate, "read": read_rate}
        self._burst_s, self._depth, self._retry_after = burst_s, prefix_depth, retry_after_s
        self._buckets: dict[tuple[RequestKind, str], TokenBucket] = {}
        self.passed: Counter[str] = Counter()
        self.throttled: Counter[str] = Counter()
        self.sent: Counter[str] = Counter()
        self.writes: list[tuple[float, bool]] = []
        self.endpoint = ""
        self._loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._serve, name="throttling-proxy", daemon=True)

    def __enter__(self) -> ThrottlingProxy:
        self._thread.start()
        if not self._started.wait(10) or not self.endpoint:
            raise RuntimeError("the throttling proxy did not start")
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._stop is not None
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)

    def write_rate_while_throttling(self) -> float:
        """Writes passed a second from the first throttled write to the last: what the clients
        got of `write_rate` while they asked for more (0.0 if none was throttled)."""
        times = [t for t, passed in self.writes if not passed]
        if len(times) < 2:
            return 0.0
        begin, end = times[0], times[-1]
        return sum(passed and begin <= t <= end for t, passed in self.writes) / (end - begin)

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._run())
        finally:
            self._started.set()  # a failed start must not leave __enter__ waiting
            self._loop.close()

    async def _run(self) -> None:
        self._stop = asyncio.Event()
        # auto_decompress off: bodies pass byte for byte, as signed.
        async with aiohttp.ClientSession(auto_decompress=False) as session:
            self._session = session
            app = web.Application(client_max_size=1 << 40)
            app.router.add_route("*", "/{tail:.*}", self._handle)
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            port = runner.addresses[0][1]
            self.endpoint = f"http://127.0.0.1:{port}"
            self._started.set()
            await self._stop.wait()
            await runner.cleanup()

    def _admit(self, kind: RequestKind, path: str) -> bool:
        rate = self._rates[kind]
        if rate is None:
            return True
        key = (kind, prefix_of(path, self._depth))
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = TokenBucket(rate, max(1.0, rate * self._burst_s))
        return bucket.take(time.monotonic())

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        kind: RequestKind = "write" if request.method in WRITES else "read"
        body = await request.read()  # the whole request, throttled or not: the connection stays
        admitted = self._admit(kind, request.path)
        (self.passed if admitted else self.throttled)[request.method] += 1
        if kind == "write":
            self.writes.append((time.monotonic(), admitted))
        if not admitted:
            return self._slow_down()
        self.sent[request.method] += len(body)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS}
        async with self._session.request(
            request.method,
            yarl.URL(self._upstream + request.raw_path, encoded=True),
            headers=headers,  # Host included: the signature covers it
            data=body if body else None,
            allow_redirects=False,
            skip_auto_headers=("Content-Type", "User-Agent", "Accept", "Accept-Encoding"),
        ) as upstream:
            payload = await upstream.read()
            answer = web.Response(status=upstream.status, body=payload)
            for k, v in upstream.headers.items():
                if k.lower() not in HOP_HEADERS:
                    answer.headers.add(k, v)
            if request.method == "HEAD":  # no body, but the object's size
                answer.headers["Content-Length"] = upstream.headers.get("Content-Length", "0")
            return answer

    def _slow_down(self) -> web.Response:
        request_id = uuid.uuid4().hex[:16].upper()
        headers = {"Content-Type": "application/xml", "x-amz-request-id": request_id}
        if self._retry_after is not None:
            headers["Retry-After"] = str(self._retry_after)
        return web.Response(
            status=503, text=SLOW_DOWN.format(request_id=request_id), headers=headers
        )
