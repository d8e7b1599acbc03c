"""`make demo`'s path end to end: a local Ray head, `ray job submit` of the demo job config,
the store it leaves and the head stopped afterwards."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import requests

from store.format import Store
from tools import demo

pytestmark = pytest.mark.slow


def test_ray_job_submit_runs_the_demo_job_end_to_end(
    models_dir: Path, tmp_path: Path, capfd: pytest.CaptureFixture
) -> None:
    status = demo.main(["--models", str(models_dir), "--out", str(tmp_path)])
    out = capfd.readouterr().out

    assert status == 0, out[-5000:]
    store = Store.open(tmp_path / "demo.zarr")
    assert store.committed().all()
    assert (np.asarray(store.group["sample_status"][:]) == 1).all()
    report = store.group.attrs["report"]
    assert report["ok"] and report["samples"]["written"] == store.num_samples == 23
    assert store.rejected == [{"sample_id": "bad-empty", "reason": "empty text"}]
    # The job's own log came back through `ray job submit`: plan, progress, report.
    for line in ("storage estimate", "ETA", "hidden-state extraction report", "succeeded"):
        assert line in out, line
    # The head it started is gone.
    address = next(w for w in out.split() if w.startswith("http://127.0.0.1:"))
    with pytest.raises(requests.ConnectionError):
        requests.get(f"{address}/api/jobs/", timeout=5)
