"""Where a store lives: a local directory (or shared POSIX mount), or object storage by URL.

`s3://bucket/prefix.zarr` (and every other scheme obstore serves: `gs://`, `az://`, ...) opens
through zarr's `ObjectStore` over obstore, chosen over fsspec/s3fs by measurement
(docs/running-a-job.md): ~2.5x less client CPU per byte PUT and ~1.6x less per byte read, 16 MB
with no dependencies, and usable from any event loop. Endpoint, region and credentials come
from the environment (`AWS_ENDPOINT_URL`, `AWS_REGION`, `AWS_ACCESS_KEY_ID`,
`AWS_SECRET_ACCESS_KEY`, ...) or from `storage_options` (obstore's config keys, plus
`client_options` and `retry_config`).

PUTs are retried here, not by obstore (whose retries would hide them): S3 answers `503
SlowDown` to a prefix's requests above its rate, and such an answer is retried with backoff for
as long as `retry_timeout` allows, however many, and counted (`ThrottleTally`); any other
failure obstore would retry gets `max_retries` retries in the same time. Reads keep obstore's
own retries. Throttling at scale: docs/design/object-storage.md.

Secrets are never part of a URL here and never printed: every error names the URL alone, with any
secret value that reaches a message replaced by `***`.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import os
import random
import re
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import obstore
import obstore.exceptions
from zarr.abc.store import Store as ZarrStore
from zarr.core.buffer import Buffer
from zarr.core.sync import sync
from zarr.storage import LocalStore, ObjectStore

# A chunk PUT or GET that hangs must fail well inside a lease (minutes), not block a worker.
DEFAULT_CLIENT_OPTIONS = {"connect_timeout": "5s", "timeout": "60s"}
DEFAULT_RETRY = {
    "max_retries": 4,
    "retry_timeout": datetime.timedelta(seconds=120),
    "backoff": {"init_backoff": datetime.timedelta(milliseconds=100), "base": 2},
}
# Durations in client_options (obstore parses "60s", "500ms") and retry_config (timedeltas).
CLIENT_DURATIONS = (
    "timeout",
    "connect_timeout",
    "pool_idle_timeout",
    "http2_keep_alive_interval",
    "http2_keep_alive_timeout",
)
BACKOFF_DURATIONS = ("init_backoff", "max_backoff")
OBSTORE_MAX_BACKOFF = datetime.timedelta(seconds=15)  # obstore's default where none is set
OBSTORE_INIT_BACKOFF = datetime.timedelta(milliseconds=100)
# How a failed request reads in obstore's errors: an HTTP status, or none reached (the
# connection refused, reset or timed out).
_STATUS = re.compile(r"non-2xx status code: (\d{3})")
_NO_ANSWER = "HTTP error"
THROTTLED_STATUSES = (503, 429)  # S3's SlowDown; 429 where other stores throttle
_DURATION_UNITS = {"ms": 1e-3, "s": 1.0, "sec": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0}
# What names a secret, in obstore's option keys (S3, Azure, GCS: aws_session_token,
# azure_storage_account_key, azure_storage_sas_key, azure_client_secret, google_service_account_key,
# bearer_token, ...) and in the environment variables they come from.
SECRET_WORDS = ("secret", "token", "password", "key", "sas", "credential")
SECRET_ENV_PREFIXES = ("AWS_", "AZURE_", "GOOGLE_", "GCS_", "OBJECT_STORE_")


class StoreAccessError(RuntimeError):
    """The store's location cannot be used (no bucket, refused credentials, no endpoint, or a
    prefix holding something else). The message names the URL, never a secret."""


def is_remote(url: str | Path) -> bool:
    return "://" in str(url) and not str(url).startswith("file://")


@dataclass(frozen=True)
class PutRetry:
    """How a PUT is retried: a throttled answer as long as `timeout_s` allows; another failure
    obstore would retry (a 5xx, no answer) `max_retries` times in that time. The backoff
    before retry n (n from 0, whatever failed) is uniform in [0, min(max_backoff_s,
    init_backoff_s * base ** n)) ("full jitter": writers throttled together do not come back
    together). The last retry starts by timeout_s + max_backoff_s, as obstore's own would
    (cluster/config.py store_write_bound_s)."""

    max_retries: int
    timeout_s: float
    init_backoff_s: float
    max_backoff_s: float
    base: float

    @classmethod
    def of(cls, retry: Mapping[str, Any]) -> PutRetry:
        """From a retry_config as obstore_options returns it."""
        backoff = retry["backoff"]
        return cls(
            max_retries=retry["max_retries"],
            timeout_s=retry["retry_timeout"].total_seconds(),
            init_backoff_s=backoff.get("init_backoff", OBSTORE_INIT_BACKOFF).total_seconds(),
            max_backoff_s=backoff.get("max_backoff", OBSTORE_MAX_BACKOFF).total_seconds(),
            base=backoff.get("base", 2),
        )


def failed_status(exc: BaseException) -> int | None:
    """The HTTP status of a failed obstore request; 0 where no answer came; None where it
    failed otherwise."""
    if not isinstance(exc, obstore.exceptions.BaseError):
        return None
    text = str(exc)
    if status := _STATUS.search(text):
        return int(status[1])
    return 0 if _NO_ANSWER in text else None


class ThrottleTally:
    """Counts the throttled answers met by the PUTs made while `counting()`: on the thread that
    entered it, and those zarr makes for that thread's writes (its event loop runs them in the
    caller's context)."""

    def __init__(self) -> None:
        self.count = 0
        self._lock = threading.Lock()

    @contextmanager
    def counting(self) -> Iterator[ThrottleTally]:
        token = _TALLY.set(self)
        try:
            yield self
        finally:
            _TALLY.reset(token)

    def add(self, n: int) -> None:
        with self._lock:
            self.count += n


_TALLY: ContextVar[ThrottleTally | None] = ContextVar("throttle_tally", default=None)


class _PutAttempts:
    """One PUT's attempts: after each failure, how long to wait before the next, or raise."""

    def __init__(self, policy: PutRetry) -> None:
        self.policy, self.started = policy, time.monotonic()
        self.throttled = self.other_retries = 0

    def wait_after(self, exc: BaseException) -> float:
        status, p = failed_status(exc), self.policy
        elapsed = time.monotonic() - self.started
        throttled = status in THROTTLED_STATUSES
        if throttled:
            self.throttled += 1
        elif status is None or 0 < status < 500 or self.other_retries >= p.max_retries:
            raise exc  # not retryable (refused, not found, ...), or retried enough
        if elapsed >= p.timeout_s:
            if self.throttled:
                exc.add_note(
                    f"{self.throttled} throttled answers (503 SlowDown or 429) retried over "
                    f"{elapsed:.1f} s; retry_config.retry_timeout is {p.timeout_s:g} s"
                )
            raise exc
        self.other_retries += not throttled
        retries = self.throttled + self.other_retries  # the backoff grows with each
        return random.uniform(0, min(p.max_backoff_s, p.init_backoff_s * p.base ** (retries - 1)))

    def tally(self) -> None:
        """Count this PUT's throttled answers, retried or not, where a tally is counting."""
        if self.throttled and (tally := _TALLY.get()) is not None:
            tally.add(self.throttled)


class SinglePutObjectStore(ObjectStore):
    """zarr's ObjectStore with one PUT per chunk: its default multipart upload turns each chunk
    over 5 MiB into 5 requests (measured against moto), and a single PUT is atomic. PUTs go
    through `puts` (the same location, obstore retrying nothing) and are retried by `retry`;
    the throttled answers they meet count in the ThrottleTally counting then, if any."""

    def __init__(self, store: Any, *, read_only: bool = False, puts: Any, retry: PutRetry) -> None:
        super().__init__(store, read_only=read_only)
        self.puts, self.retry = puts, retry

    def with_read_only(self, read_only: bool = False) -> SinglePutObjectStore:
        return type(self)(self.store, read_only=read_only, puts=self.puts, retry=self.retry)

    async def set(self, key: str, value: Buffer) -> None:
        self._check_writable()
        await self._put_retried(key, value, mode="overwrite")

    async def set_if_not_exists(self, key: str, value: Buffer) -> None:
        """Create-only (If-None-Match on S3): an object already at `key` stays. Retried as every
        PUT (obstore would not retry a create that timed out): a retry that finds the object,
        its own earlier attempt's or another writer's, is done, as zarr's own is."""
        self._check_writable()
        with contextlib.suppress(obstore.exceptions.AlreadyExistsError):  # 412: not retried
            await self._put_retried(key, value, mode="create")

    async def _put_retried(self, key: str, value: Buffer, mode: str) -> None:
        attempts = _PutAttempts(self.retry)
        try:
            while True:
                try:
                    await obstore.put_async(
                        self.puts, key, value.as_buffer_like(), use_multipart=False, mode=mode
                    )
                    return
                except Exception as exc:
                    await asyncio.sleep(attempts.wait_after(exc))
        finally:
            attempts.tally()

    def put_parts(self, key: str, parts: list[memoryview]) -> None:
        """One PUT of the parts' bytes, in order, as the object at `key` (relative to the store's
        root, as zarr's keys are): for a writer that has an object's bytes in pieces, without
        joining them in Python first (obstore takes the pieces as they are)."""
        self._check_writable()
        attempts = _PutAttempts(self.retry)
        try:
            while True:
                try:
                    obstore.put(self.puts, key, parts, use_multipart=False)
                    break
                except Exception as exc:
                    time.sleep(attempts.wait_after(exc))
        finally:
            attempts.tally()


def _endpoint(options: Mapping[str, Any]) -> str:
    for key in ("endpoint", "endpoint_url", "aws_endpoint"):
        if key in options:
            return str(options[key])
    return os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL", "")


def open_location(
    url: str | Path, storage_options: Mapping[str, Any] | None = None, *, read_only: bool = False
) -> str | ZarrStore:
    """What zarr opens for `url`: the path itself for a local store, else an ObjectStore."""
    if not is_remote(url):
        return str(url).removeprefix("file://")
    client, retry, options = obstore_options(storage_options or {})
    if _endpoint(options).startswith("http://"):  # the user chose a plain-HTTP endpoint
        client.setdefault("allow_http", True)
    try:
        backend, puts = (
            obstore.store.from_url(str(url), client_options=client, retry_config=r, **options)
            for r in (retry, {**retry, "max_retries": 0})  # reads; PUTs, retried by PutRetry
        )
    except Exception as exc:
        raise StoreAccessError(describe_failure(url, exc, storage_options)) from None
    return SinglePutObjectStore(backend, read_only=read_only, puts=puts, retry=PutRetry.of(retry))


def obstore_options(storage_options: Mapping[str, Any]) -> tuple[dict, dict, dict]:
    """(client_options, retry_config, the other options) as obstore takes them, the user's
    over our defaults. Durations may be written as seconds or as "30s", "1m 30s", "500ms" (all
    a YAML file can hold); a value obstore would refuse raises ValueError naming its option."""
    rest = dict(storage_options)
    client = _mapping(rest.pop("client_options", {}), "client_options")
    retry = _mapping(rest.pop("retry_config", {}), "retry_config")
    client, retry = {**DEFAULT_CLIENT_OPTIONS, **client}, {**DEFAULT_RETRY, **retry}
    for key in CLIENT_DURATIONS:
        if key in client:  # milliseconds: obstore's parser takes no fractions
            client[key] = f"{round(duration_s(client[key], f'client_options.{key}') * 1000)}ms"
    if "retry_timeout" in retry:
        seconds = duration_s(retry["retry_timeout"], "retry_config.retry_timeout")
        retry["retry_timeout"] = datetime.timedelta(seconds=seconds)
    retries = retry.get("max_retries")
    if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
        raise ValueError(f"retry_config.max_retries: expected a count, got {retries!r}")
    backoff = dict(_mapping(retry.get("backoff", {}), "retry_config.backoff"))
    for key in BACKOFF_DURATIONS:
        if key in backoff:
            seconds = duration_s(backoff[key], f"retry_config.backoff.{key}")
            backoff[key] = datetime.timedelta(seconds=seconds)
    base = backoff.get("base", 2)
    if isinstance(base, bool) or not isinstance(base, int | float) or base < 1:
        raise ValueError(f"retry_config.backoff.base: expected a number >= 1, got {base!r}")
    retry["backoff"] = backoff
    return client, retry, rest


def _mapping(value: Any, name: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ValueError(f"{name}: expected a mapping of options, got {type(value).__name__}")
    return value


def duration_s(value: Any, name: str) -> float:
    """An obstore duration (timedelta, seconds, or "60s", "1m 30s", "500ms") in seconds."""
    if isinstance(value, datetime.timedelta):
        return value.total_seconds()
    if isinstance(value, int | float) and not isinstance(value, bool) and value >= 0:
        return float(value)
    text = str(value).strip().lower()
    pairs = re.findall(r"(\d+(?:\.\d+)?)\s*([a-z]+)\s*", text)
    if not re.fullmatch(r"(\d+(\.\d+)?\s*[a-z]+\s*)+", text) or any(
        unit not in _DURATION_UNITS for _, unit in pairs
    ):
        raise ValueError(f"{name}: cannot read {value!r} as a duration (e.g. 60s, 1m 30s, 500ms)")
    return sum(float(n) * _DURATION_UNITS[unit] for n, unit in pairs)


def describe_failure(
    url: str | Path, exc: BaseException, storage_options: Mapping[str, Any] | None = None
) -> str:
    """`url: <what went wrong>`, with every known secret value masked."""
    return mask_secrets(f"{url}: {type(exc).__name__}: {exc}", storage_options)


def mask_secrets(text: str, storage_options: Mapping[str, Any] | None = None) -> str:
    """`text` with the value of every storage option and object-storage environment variable
    whose name says secret (SECRET_WORDS) masked. Masking a key id too is harmless; values
    under 4 characters are left (they would mask ordinary text)."""
    named = [(k, v) for k, v in os.environ.items() if k.upper().startswith(SECRET_ENV_PREFIXES)]
    named += list((storage_options or {}).items())
    secrets = {str(v) for k, v in named if any(w in k.lower() for w in SECRET_WORDS)}
    for secret in sorted(secrets, key=len, reverse=True):  # a secret inside another: longest first
        if len(secret) >= 4:
            text = text.replace(secret, "***")
    return text


def first_key(location: str | ZarrStore) -> str | None:
    """Any object already stored at the location, or None when it is empty (or absent)."""
    if isinstance(location, str):
        if not Path(location).exists():
            return None
        location = LocalStore(location, read_only=True)

    async def first() -> str | None:
        async for key in location.list_prefix(""):
            return key
        return None

    return sync(first())
