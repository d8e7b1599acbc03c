"""`make demo`'s path end to end: a local Ray head, `ray job submit` of the demo job config,
the store it leaves and the head stopped afterwards."""

from __future__ import annotations

import contextlib
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import requests

from hsx_store.format import Store
from tools.demo import REPO
from tools.s3_server import S3Server


def test_ray_job_submit_runs_the_demo_job_end_to_end_on_s3_through_the_environment_alone(
    demo: Callable[[list[str]], int],
    models_dir: Path,
    tmp_path: Path,
    s3: S3Server,
    capfd: pytest.CaptureFixture,
) -> None:
    """As on a cluster without a shared filesystem: the store's endpoint and credentials are in
    the environment the Ray head starts with (so its workers and the job have them), not in the
    job's config. With a log growing in the checkout meanwhile, as `make demo > demo.log` makes
    one: the job's package leaves it out (before, the job's runtime environment failed to set
    up). The demo's default store, a local directory, is the one every other job test uses."""
    url = s3.url(f"{tmp_path.name}/demo.zarr")
    with (
        pytest.MonkeyPatch.context() as env,
        growing_file(REPO / f"demo-{uuid.uuid4().hex[:8]}.log"),
    ):
        for name, value in s3.environment.items():
            env.setenv(name, value)
        status = demo(["--models", str(models_dir), "--out", str(tmp_path), "--store", url])
    out = capfd.readouterr().out

    assert status == 0, out[-5000:]
    store = Store.open(url, storage_options=s3.options)
    assert not list(tmp_path.rglob("zarr.json")), "nothing of the store is on local disk"
    assert store.committed().all()
    assert (np.asarray(store.group["sample_status"][:]) == 1).all()
    report = store.group.attrs["report"]
    assert report["ok"] and report["samples"]["written"] == store.num_samples == 25
    assert store.rejected == [{"sample_id": "bad-empty", "reason": "empty text"}]
    # The job's own log came back through `ray job submit`: plan, progress, report.
    for line in ("storage estimate", "ETA", "hidden-state extraction report", "succeeded"):
        assert line in out, line
    # Not a terminal: a progress line every driver.log_interval_s (10 s in the demo config) and
    # on each change of state, not one per 2 s poll.
    progress = [line for line in out.splitlines() if "| elapsed " in line]
    assert 1 <= len(progress) <= report["run"]["seconds"] / 10 + 8, progress
    assert s3.secret_access_key not in out
    # The head it started is gone.
    address = next(w for w in out.split() if w.startswith("http://127.0.0.1:"))
    with pytest.raises(requests.ConnectionError):
        requests.get(f"{address}/api/jobs/", timeout=5)


@contextlib.contextmanager
def growing_file(path: Path) -> Iterator[None]:
    """A file that grows every 10 ms while the block runs, removed afterwards."""
    stop = threading.Event()

    def grow() -> None:
        with path.open("a") as f:
            while not stop.wait(0.01):
                f.write("a line of a log still being written\n")
                f.flush()

    writer = threading.Thread(target=grow, daemon=True)
    writer.start()
    try:
        yield
    finally:
        stop.set()
        writer.join()
        path.unlink(missing_ok=True)
