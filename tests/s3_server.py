"""A real S3-protocol server on loopback for tests: moto's server mode, started in-process."""

from __future__ import annotations

import logging
import socket
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import boto3
from moto.server import ThreadedMotoServer

# moto accepts any key; these are placeholders, and a unique secret lets tests prove that no
# message ever carries it.
ACCESS_KEY = "hsx-test-access"
SECRET_KEY = f"hsx-test-secret-{uuid.uuid4().hex}"
REGION = "us-east-1"


@dataclass(frozen=True)
class S3Server:
    endpoint: str
    bucket: str

    @property
    def options(self) -> dict[str, Any]:
        """`store.storage_options` for this server."""
        return {
            "endpoint": self.endpoint,
            "region": REGION,
            "access_key_id": ACCESS_KEY,
            "secret_access_key": SECRET_KEY,
        }

    def url(self, name: str) -> str:
        return f"s3://{self.bucket}/{name}"

    def keys(self, prefix: str = "") -> list[str]:
        pages = (
            self.client()
            .get_paginator("list_objects_v2")
            .paginate(Bucket=self.bucket, Prefix=prefix)
        )
        return [o["Key"] for page in pages for o in page.get("Contents", [])]

    def client(self) -> Any:
        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            region_name=REGION,
            aws_access_key_id=ACCESS_KEY,
            aws_secret_access_key=SECRET_KEY,
        )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def s3_server(bucket: str = "hsx-test") -> Iterator[S3Server]:
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # a line per request otherwise
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        s3 = S3Server(f"http://127.0.0.1:{port}", bucket)
        s3.client().create_bucket(Bucket=bucket)
        yield s3
    finally:
        server.stop()
