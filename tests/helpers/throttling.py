"""Storage options through the loopback throttling endpoint (tools/throttling_proxy.py), for
the tests of object storage under S3's 503 SlowDown."""

from __future__ import annotations

from typing import Any

from tools.s3_server import S3Server
from tools.throttling_proxy import ThrottlingProxy

WRITE_RATE = 10  # PUTs a second the throttling endpoint passes per prefix


def through(proxy: ThrottlingProxy, s3: S3Server, **retry: Any) -> dict[str, Any]:
    """Storage options for the S3 server behind `proxy`: throttled PUTs retried for up to 30 s,
    backing off at most 1 s (retry_config overridden by `retry`)."""
    backoff = {"init_backoff": "50ms", "max_backoff": "1s"}
    return {
        **s3.options,
        "endpoint": proxy.endpoint,
        "retry_config": {"retry_timeout": "30s", "backoff": backoff, **retry},
    }
