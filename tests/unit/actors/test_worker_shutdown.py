"""A worker's shutdown against a server restart under way in its generation thread: the restart
is waited for and its server stopped, the folders go and stay gone, and no restart begins once
the worker stops. (A restart that raced the shutdown left a server running and the worker's
folders made anew after their release: the fault campaign's `held by no process` leftovers.)

The server is a stand-in (what is under test is the worker's locking, not SGLang): a start
that takes a while and makes its dump folder, as the real one does."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from actors.config import WorkerConfig
from actors.node_worker import DUMPS_PREFIX, LOGS_PREFIX, NodeWorker, WorkerStopping
from actors.private_folders import HeldFolder

START_S = 0.5  # how long the stand-in server takes to start


class StandInServer:
    def __init__(self) -> None:
        self.running, self.stopped = True, False

    def alive(self) -> bool:
        return self.running

    def healthy(self) -> bool:
        return self.running

    def log_tail(self) -> str:
        return "(its log)"

    def stop(self) -> None:
        self.running, self.stopped = False, True


def worker_with_a_dead_server(tmp_path: Path) -> tuple[object, list[StandInServer]]:
    """The worker's own methods on the state they use; `started`: each server its restarts
    started."""
    config = WorkerConfig(dump_root=str(tmp_path / "dumps"), log_root=str(tmp_path / "logs"))
    worker = object.__new__(NodeWorker.__ray_actor_class__)
    dead = StandInServer()
    dead.stop()
    started: list[StandInServer] = []
    worker.__dict__.update(
        id="w1",
        config=config,
        job=SimpleNamespace(server=SimpleNamespace(restarts=5, restart_backoff_s=0.0)),
        metrics=SimpleNamespace(restarts=SimpleNamespace(inc=lambda: None)),
        restarts=0,
        server=dead,
        _server_lock=threading.Lock(),
        _stopping=threading.Event(),
        dumps=HeldFolder.claim(Path(config.dump_root), f"{DUMPS_PREFIX}w1-"),
        logs=HeldFolder.claim(Path(config.log_root), f"{LOGS_PREFIX}w1-"),
    )

    def start_server() -> None:  # as _start_server: the server's dump folder, then its start
        (worker.dumps.path / f"server-{worker.restarts}").mkdir(parents=True)
        time.sleep(START_S)
        started.append(StandInServer())
        worker.server = started[-1]

    worker._start_server = start_server
    return worker, started


def test_shutdown_waits_for_a_restart_under_way_and_stops_its_server(tmp_path: Path) -> None:
    worker, started = worker_with_a_dead_server(tmp_path)
    restart = threading.Thread(target=worker._restart_server)
    restart.start()
    while not list(worker.dumps.path.glob("server-*")):  # the restart has begun its start
        time.sleep(0.01)
    worker.shutdown()
    restart.join()
    assert len(started) == 1 and started[0].stopped  # the server it started did not live on
    assert worker.server is None
    assert list((tmp_path / "dumps").iterdir()) == [] and list((tmp_path / "logs").iterdir()) == []


def test_no_restart_begins_once_the_worker_stops(tmp_path: Path) -> None:
    worker, started = worker_with_a_dead_server(tmp_path)
    worker.shutdown()
    with pytest.raises(WorkerStopping, match="w1 is stopping"):
        worker._restart_server()
    assert started == [] and list((tmp_path / "dumps").iterdir()) == []
