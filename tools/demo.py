"""`make demo`: the whole job, as a user runs it, on this machine.

Makes the tiny DeepseekV3 (once, into .cache/models), starts a local Ray head advertising one
GPU-node resource (`sglang_node`; the "node" serves on CPU here), `ray job submit`s the demo
job (ray_configs/demo_job.yaml: the prompts kept in ray_configs/demo_prompts.jsonl, a local Zarr
directory), streams its log (plan, storage estimate, progress, final report) and stops the head
it started. Exit status: the job's.

`--s3` runs the same job with its store on object storage, as a cluster without a shared
filesystem does: a loopback S3 server (tools/s3_server.py) is started first and its endpoint and
credentials reach the driver and every worker only through the `AWS_*` environment the Ray head
is started with, never through the job's config.

`--images` runs the image demo instead (`make demo-images`): the tiny Qwen2.5-VL and
ray_configs/demo_image_job.yaml, rows with images (ray_configs/demo_image_prompts.jsonl).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

from tools.ray_head import BIN, local_head
from tools.s3_server import s3_server
from tools.tiny_models import ensure_models

REPO = Path(__file__).resolve().parent.parent


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=Path, default=REPO / ".cache/models")
    parser.add_argument("--out", type=Path, default=REPO / "out/demo")
    parser.add_argument("--config", type=Path, help="default: the demo's (or the image demo's)")
    parser.add_argument("--store", help="the store's URL (default: a directory under --out)")
    parser.add_argument("--s3", action="store_true", help="the store on a loopback S3 server")
    parser.add_argument("--images", action="store_true", help="the image demo (tiny Qwen2.5-VL)")
    args = parser.parse_args(argv)

    name, config, store_name = (
        ("qwen25-vl-tiny", "demo_image_job.yaml", "demo-images.zarr")
        if args.images
        else ("deepseek-v3-tiny", "demo_job.yaml", "demo.zarr")
    )
    config = args.config or Path("ray_configs") / config
    model = ensure_models(args.models, [name])[name]
    out = args.out.resolve()
    with ExitStack() as stack:
        if args.s3:
            s3 = stack.enter_context(s3_server())
            store = s3.url(store_name)
            stack.enter_context(_environment(s3.environment))  # what `ray start` inherits
            print(f"S3 server on {s3.endpoint}; the store goes to {store}", flush=True)
        elif args.store:
            store = args.store  # a remote one is reached with the `AWS_*` environment
        else:
            store = str(out / store_name)
            shutil.rmtree(store, ignore_errors=True)  # the demo starts over; a job would resume
        print(f"starting a local Ray head (log: {out / 'ray-head.log'}) ...", flush=True)
        head = local_head({"sglang_node": 1}, num_cpus=2, log_path=out / "ray-head.log")
        with head as (address, env):
            print(f"Ray head up, job API at {address}", flush=True)
            cmd = [
                str(BIN / "ray"), "job", "submit", "--address", address,
                "--runtime-env", "ray_configs/runtime_env.yaml",
                "--", "python", "-m", "cluster", "run", "--config", str(config),
                "--set", f"model.path={model.resolve()}",
                "--set", f"store.url={store}",
            ]  # fmt: skip
            print("$ " + " ".join(cmd), flush=True)
            status = subprocess.run(cmd, cwd=REPO, env=env, check=False).returncode
        print(f"\nstore: {store} (ray job submit exited {status}; the head is stopped)", flush=True)
    return status


@contextmanager
def _environment(variables: dict[str, str]) -> Iterator[None]:
    saved = {name: os.environ.get(name) for name in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


if __name__ == "__main__":
    sys.exit(main())
