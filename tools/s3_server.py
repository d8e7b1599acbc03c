"""A real S3-protocol server on loopback, for tests, benchmarks and trying a job on S3 locally.

moto's server mode in its own process (benchmarks measure the client, so the server must not take
the client's GIL), listening on 127.0.0.1 only and checking every request's signature: moto
enforces credentials once `INITIAL_NO_AUTH_ACTION_COUNT` is set, after that many unauthenticated
requests, which are the ones that create our IAM user, its key and its policy. The bucket is then
created with that key, and a request with any other key or secret is refused (403), as on AWS.

    with s3_server() as s3:
        Store.open(s3.url("run.zarr"), storage_options=s3.options)
    .venv/bin/python -m tools.s3_server      # serve until Ctrl-C; prints the AWS_* settings
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import boto3
import requests

from actors.ports import free_port

REGION = "us-east-1"
USER = "hsx"
POLICY = {
    "Version": "2012-10-17",
    "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}],
}
SETUP_ACTIONS = 3  # create_user, create_access_key, put_user_policy: unauthenticated
# moto keeps an object in memory up to this size and spills larger ones to a temp file; chunks
# are tens of MB, and a benchmark must not measure moto's disk.
KEY_BUFFER_BYTES = 256 << 20
START_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class S3Server:
    endpoint: str
    bucket: str
    access_key_id: str
    secret_access_key: str

    @property
    def options(self) -> dict[str, Any]:
        """`store.storage_options` for this server."""
        return {
            "endpoint": self.endpoint,
            "region": REGION,
            "access_key_id": self.access_key_id,
            "secret_access_key": self.secret_access_key,
        }

    @property
    def environment(self) -> dict[str, str]:
        """The same settings as the `AWS_*` variables a node's environment would carry."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_REGION": REGION,
            "AWS_ACCESS_KEY_ID": self.access_key_id,
            "AWS_SECRET_ACCESS_KEY": self.secret_access_key,
            "AWS_ALLOW_HTTP": "true",
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
        return _client("s3", self.endpoint, self.access_key_id, self.secret_access_key)


def _client(service: str, endpoint: str, key_id: str, secret: str) -> Any:
    return boto3.client(
        service,
        endpoint_url=endpoint,
        region_name=REGION,
        aws_access_key_id=key_id,
        aws_secret_access_key=secret,
    )


def _wait_until_up(endpoint: str, process: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"moto server exited with status {process.returncode}")
        try:
            # moto's own API: not an S3 or IAM action, so it does not use up SETUP_ACTIONS.
            requests.get(f"{endpoint}/moto-api/data.json", timeout=1)
            return
        except requests.ConnectionError:
            time.sleep(0.1)
    raise RuntimeError(f"moto server at {endpoint} did not answer within {START_TIMEOUT_S:.0f} s")


@contextmanager
def s3_server(bucket: str = "hsx-test") -> Iterator[S3Server]:
    """Start the server, make a user with a key and the bucket; stop the server on exit."""
    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    env = {
        **os.environ,
        "INITIAL_NO_AUTH_ACTION_COUNT": str(SETUP_ACTIONS),
        "MOTO_S3_DEFAULT_KEY_BUFFER_SIZE": str(KEY_BUFFER_BYTES),
    }
    with tempfile.TemporaryFile() as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
            env=env,
            stdout=log,
            stderr=log,
        )
        try:
            try:
                s3 = _set_up(endpoint, bucket, process)
            except Exception:
                log.seek(0)
                sys.stderr.write(log.read()[-4000:].decode(errors="replace"))
                raise
            yield s3
        finally:
            process.terminate()
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def _set_up(endpoint: str, bucket: str, process: subprocess.Popen[bytes]) -> S3Server:
    _wait_until_up(endpoint, process)
    iam = _client("iam", endpoint, "setup", "setup")  # any key: auth is not on yet
    iam.create_user(UserName=USER)
    key = iam.create_access_key(UserName=USER)["AccessKey"]
    iam.put_user_policy(UserName=USER, PolicyName="s3", PolicyDocument=json.dumps(POLICY))
    s3 = S3Server(endpoint, bucket, key["AccessKeyId"], key["SecretAccessKey"])
    s3.client().create_bucket(Bucket=bucket)
    return s3


def main() -> None:
    """Serve until Ctrl-C; the credentials go to a private file, never to the terminal."""
    with s3_server() as s3, tempfile.TemporaryDirectory(prefix="hsx-s3-") as tmp:
        env_file = Path(tmp) / "s3.env"
        env_file.touch(mode=0o600)
        env_file.write_text("".join(f"export {k}={v}\n" for k, v in s3.environment.items()))
        print(f"S3 server on {s3.endpoint}, bucket {s3.bucket}. In another shell:")
        print(f"  source {env_file}")
        print(f"  ... --set store.url={s3.url('run.zarr')}")
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            pass


if __name__ == "__main__":
    main()
