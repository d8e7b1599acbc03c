"""Following a store while its shards commit: every committed sample once, in each consumer's
share; the end of the job, or of the wait, said; a cursor saved mid-way resumes exactly after
what was yielded; an export that follows writes what a plain one writes, shard by shard. The
shards are written and committed by the real shard writer, in a thread (the job's stand-in) or
in the test between reads."""

from __future__ import annotations

import itertools
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from torch.utils.data import DataLoader
from torchdata.stateful_dataloader import StatefulDataLoader

from hsx_store.export import read_exported, sample_path
from hsx_store.format import Store
from hsx_store.reader import COMPLETE, HiddenStatesIterable
from tests.helpers.exports import assert_same, export
from tests.helpers.synthetic import (
    assert_sample_exact,
    finish_plan,
    new_store,
    plan,
    planning_store,
    write_shard,
)

NAMES = plan()[0]
ALL = list(range(len(NAMES)))  # every sample of the synthetic plan (3 shards)
FAST = {"poll_s": 0.02, "max_poll_s": 0.05}


def committing(store: Store, shards: list[int], every_s: float) -> threading.Thread:
    """Commit `shards` one after the other from a thread, `every_s` apart, the first at once."""

    def run() -> None:
        for k in shards:
            write_shard(store, k)
            time.sleep(every_s)

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def ids(samples: Iterator[dict]) -> list[int]:
    return [NAMES.index(s["sample_id"]) for s in samples]


def test_a_follower_yields_each_sample_once_as_shards_commit_and_ends_when_complete(
    tmp_path: Path,
) -> None:
    store = new_store(tmp_path / "s.zarr")
    write_shard(store, 1)  # before the reader starts: read first
    reader = HiddenStatesIterable(str(tmp_path / "s.zarr"), follow=True, **FAST)
    thread = committing(store, [2, 0], every_s=0.3)
    seen = []
    for sample in reader:
        assert_sample_exact(sample, NAMES.index(sample["sample_id"]), "bfloat16")
        seen.append(NAMES.index(sample["sample_id"]))
    thread.join()
    shards = [store.shards[k] for k in (1, 2, 0)]
    assert seen == [i for sh in shards for i in range(sh.sample_begin, sh.sample_end)]
    assert reader.ended == "the job is complete: every planned shard is committed"


def test_a_follower_ends_at_a_new_report_or_when_idle_and_says_which(tmp_path: Path) -> None:
    store = new_store(tmp_path / "s.zarr")
    write_shard(store, 0)
    store.group.attrs["report"] = {"ok": False, "finished_at": "an earlier run"}
    reader = HiddenStatesIterable(str(tmp_path / "s.zarr"), follow=True, **FAST)

    def end_the_run() -> None:
        time.sleep(0.3)
        write_shard(store, 2)  # the run's last commit, just before its report
        store.group.attrs["report"] = {"ok": False, "finished_at": "this run"}

    thread = threading.Thread(target=end_the_run)
    thread.start()
    seen = ids(reader)
    thread.join()
    assert sorted(seen) == [i for k in (0, 2) for i in range(*_samples(store, k))]
    assert reader.ended == "a run of the job ended (ok: False); 1 shards not committed"

    idle = HiddenStatesIterable(str(tmp_path / "s.zarr"), follow=True, idle_timeout_s=0.2, **FAST)
    assert sorted(ids(idle)) == sorted(seen)  # the old report is not an end: it waits
    assert idle.ended == "no shard committed for 0.2 s"


def _samples(store: Store, k: int) -> tuple[int, int]:
    return store.shards[k].sample_begin, store.shards[k].sample_end


@pytest.mark.parametrize("shuffle", [False, True])
def test_a_cursor_saved_mid_shard_resumes_right_after_while_the_job_still_writes(
    tmp_path: Path, shuffle: bool
) -> None:
    store = new_store(tmp_path / "s.zarr")
    write_shard(store, 0)
    write_shard(store, 2)
    url = str(tmp_path / "s.zarr")
    first = HiddenStatesIterable(url, follow=True, shuffle=shuffle, seed=5, **FAST)
    first.set_epoch(3)
    before = ids(itertools.islice(iter(first), 3))  # mid-shard: shard 0 has 4 samples
    state = first.state_dict()
    assert state["epoch"] == 3 and len(state["done"]) + (state["shard"] is not None) >= 1

    write_shard(store, 1)  # commits while the trainer is down
    second = HiddenStatesIterable(url, follow=True, shuffle=shuffle, seed=5, **FAST)
    second.load_state_dict(state)
    after = ids(second)
    assert sorted(before + after) == ALL and not set(before) & set(after)
    assert second.state_dict()["done"] == [0, 1, 2] and second.state_dict()["shard"] is None

    other = HiddenStatesIterable(url, rank=1, world_size=2, shuffle=shuffle, seed=5)
    other.load_state_dict(state)
    with pytest.raises(ValueError, match="saved by another reader"):
        next(iter(other))


def test_the_next_epoch_starts_afresh_and_a_shuffled_one_changes_the_order(tmp_path: Path) -> None:
    store = new_store(tmp_path / "s.zarr")
    for k in range(3):
        write_shard(store, k)
    reader = HiddenStatesIterable(str(tmp_path / "s.zarr"), shuffle=True, seed=1)
    orders = []
    for epoch in range(6):
        reader.set_epoch(epoch)
        orders.append(ids(reader))
        assert reader.state_dict()["done"] == [0, 1, 2]
    assert all(sorted(o) == ALL for o in orders) and len({tuple(o) for o in orders}) > 1


def test_two_ranks_of_two_workers_share_a_running_job_disjointly(tmp_path: Path) -> None:
    store = new_store(tmp_path / "s.zarr")
    write_shard(store, 0)
    thread = committing(store, [1, 2], every_s=0.5)  # commits while the workers poll
    seen = []
    for rank in range(2):
        reader = HiddenStatesIterable(
            str(tmp_path / "s.zarr"), rank=rank, world_size=2, follow=True, **FAST
        )
        seen += [ids([s]) for s in DataLoader(reader, batch_size=None, num_workers=2)]
    thread.join()
    assert sorted(i for (i,) in seen) == ALL


def test_a_stateful_dataloader_resumes_each_worker_where_it_stopped(tmp_path: Path) -> None:
    """torchdata's StatefulDataLoader keeps one cursor per worker: the way to checkpoint a
    reader behind DataLoader workers."""
    store = new_store(tmp_path / "s.zarr")
    for k in range(3):
        write_shard(store, k)
    url = str(tmp_path / "s.zarr")

    def loader() -> StatefulDataLoader:
        reader = HiddenStatesIterable(url, follow=True, **FAST)
        return StatefulDataLoader(reader, batch_size=None, num_workers=2)

    first = loader()
    taken = []
    for sample in first:
        taken.append(NAMES.index(sample["sample_id"]))
        if len(taken) == 5:
            state = first.state_dict()
            break
    second = loader()
    second.load_state_dict(state)
    rest = ids(second)
    assert sorted(taken + rest) == ALL and not set(taken) & set(rest)


@pytest.mark.parametrize("fmt", ["specforge", "speculators"])
def test_export_follow_writes_each_shard_as_it_commits_as_a_plain_export_would(
    tmp_path: Path, fmt: str
) -> None:
    store = new_store(tmp_path / "s.zarr")
    write_shard(store, 0)
    url, out = str(tmp_path / "s.zarr"), tmp_path / "followed"
    result: list[dict] = []
    follow = {"follow": True, "poll_s": 0.02, "say": lambda _: None}
    exporting = threading.Thread(target=lambda: result.append(export(url, out, fmt, **follow)))
    exporting.start()
    first = sample_path(out, fmt, store.shards[0].sample_begin)
    deadline = time.monotonic() + 60
    while not first.exists():  # shard 0's files come while shards 1 and 2 are not committed
        assert time.monotonic() < deadline and exporting.is_alive(), "shard 0 was not exported"
        time.sleep(0.02)
    write_shard(store, 1)
    write_shard(store, 2)
    exporting.join(60)
    (summary,) = result
    assert summary["ended"] == COMPLETE and summary["files"] == summary["exported"] == len(ALL)
    plain = export(url, tmp_path / "plain", fmt, say=lambda _: None)
    assert plain["files"] == len(ALL)
    for i in ALL:
        assert_same(read_exported(out, fmt, i), read_exported(tmp_path / "plain", fmt, i))
    doc = json.loads((out / "export.json").read_text())
    assert doc["exported"] == [[i, NAMES[i]] for i in ALL]


def test_export_follow_waits_for_the_plan_then_follows_the_commits(tmp_path: Path) -> None:
    url, out = tmp_path / "s.zarr", tmp_path / "followed"
    builder = planning_store(url)  # shards 0 and 1 planned, shard 2 not yet
    said: list[str] = []
    result: list[dict] = []
    follow = {"follow": True, "poll_s": 0.02, "say": said.append}
    exporting = threading.Thread(
        target=lambda: result.append(export(str(url), out, "speculators", **follow))
    )
    exporting.start()
    time.sleep(0.3)
    assert exporting.is_alive() and "still being planned (8 samples so far): waiting" in said[0]
    finish_plan(builder)
    store = Store.open(url, mode="r+")
    for k in range(3):
        write_shard(store, k)
    exporting.join(60)
    assert result[0]["ended"] == COMPLETE and result[0]["files"] == len(ALL)
