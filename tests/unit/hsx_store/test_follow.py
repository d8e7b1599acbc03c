"""Following a store while its shards commit: every committed sample once, in each consumer's
share; the end of the job, or of the wait, said; a cursor saved mid-way resumes exactly after
what was yielded; an export that follows writes what a plain one writes, shard by shard; a
follower or a cursor of one store never reads another made at its URL. The shards are written
and committed by the real shard writer, in a thread (the job's stand-in) or in the test between
reads."""

from __future__ import annotations

import itertools
import json
import pickle
import re
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from torch.utils.data import DataLoader
from torchdata.stateful_dataloader import StatefulDataLoader
from zarr.storage import LocalStore

from actors.shard_writer import ShardWriter
from hsx_store.builder import create_store
from hsx_store.export.run import read_exported, sample_path
from hsx_store.format import Store
from hsx_store.reader import (
    COMPLETE,
    HiddenStatesDataset,
    HiddenStatesIterable,
    StoreReplaced,
    fingerprint,
)
from tests.helpers.exports import assert_same, export
from tests.helpers.synthetic import (
    NUM_AUX,
    H,
    assert_sample_exact,
    finish_plan,
    manifest,
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


# -- a store replaced at the same URL ------------------------------------------------------

OTHER_LENGTHS = [3, 6, 2, 9, 4, 7]  # store B's plan: samples of its own, laid out otherwise


def replace_store(path: Path, same_plan: bool) -> Store:
    """Store A at `path` deleted and store B made there, every shard of it committed: the same
    plan made again (a new store_id), or another plan (B's own samples "b<j>", every row of
    sample j holding j + 1)."""
    shutil.rmtree(path)
    if same_plan:
        store = new_store(path)
        for k in range(len(store.shards)):
            write_shard(store, k)
        return store
    rng = np.random.default_rng(7)
    ids = [rng.integers(0, 1000, n).astype(np.int32) for n in OTHER_LENGTHS]
    masks = [np.ones(n, np.uint8) for n in OTHER_LENGTHS]
    store = create_store(path, manifest(), [f"b{j}" for j in range(len(ids))], ids, masks)
    for shard in store.shards:
        writer = ShardWriter(store, shard)
        for j in range(shard.sample_begin, shard.sample_end):
            n, bf16 = OTHER_LENGTHS[j], ml_dtypes.bfloat16
            writer.write_sample(
                j, np.full((n, NUM_AUX, H), j + 1, bf16), np.full((n, H), j + 1, bf16)
            )
        writer.commit({"worker": "b"})
    return store


def store_id(path: Path) -> str:
    return str(Store.open(path).group.attrs["store_id"])


@pytest.mark.parametrize("planned", [True, False], ids=["planned", "still-planning"])
@pytest.mark.parametrize("same_plan", [False, True], ids=["another-plan", "same-plan"])
def test_a_follower_whose_store_is_replaced_stops_naming_both_and_yields_nothing_of_it(
    tmp_path: Path, planned: bool, same_plan: bool
) -> None:
    """Store A followed; its shard 0 read; A deleted and store B made at its URL, every shard
    committed: the follower's next poll sees B's commits, and raises instead of reading them
    with A's layout (or, B's plan the same, at all)."""
    url = tmp_path / "s.zarr"
    if planned:
        store = new_store(url)
    else:  # A's plan still streaming in: the poll re-reads the plan too
        planning_store(url)
        store = Store.open(url, mode="r+")
    write_shard(store, 0)
    a = store_id(url)
    samples = iter(HiddenStatesIterable(str(url), follow=True, idle_timeout_s=5, **FAST))
    for i in range(4):  # shard 0's samples, the poll not made yet
        assert_sample_exact(next(samples), i, "bfloat16")
    b = replace_store(url, same_plan).group.attrs["store_id"]
    said = rf"{re.escape(str(url))}: store_id {a} when first read, store_id {b} there now"
    with pytest.raises(StoreReplaced, match=said):
        next(samples)


def test_a_cursor_of_another_store_is_refused_naming_both(tmp_path: Path) -> None:
    """A cursor saved reading store A, loaded into a reader of store B (the same plan: the
    cursor would skip B's first samples unseen) is refused; into a copy of A (the same
    store_id) it resumes. A cursor saved before cursors named their store is refused, saying
    how to load it anyway, which then works."""
    a_url, b_url, copy_url = (str(tmp_path / name) for name in ("a.zarr", "b.zarr", "c.zarr"))
    for url in (a_url, b_url):
        store = new_store(url)
        for k in range(3):
            write_shard(store, k)
    a = HiddenStatesIterable(a_url)
    before = ids(itertools.islice(iter(a), 6))
    state = a.state_dict()
    assert state["store_id"] == store_id(Path(a_url))

    b = HiddenStatesIterable(b_url)
    b_id = store_id(Path(b_url))
    said = rf"store_id {state['store_id']}, not {re.escape(b_url)} \(store_id {b_id}\)"
    with pytest.raises(ValueError, match=said):
        b.load_state_dict(state)
    assert ids(b) == ALL  # refused: nothing was loaded

    shutil.copytree(a_url, copy_url)
    copy = HiddenStatesIterable(copy_url)
    copy.load_state_dict(state)
    assert sorted(before + ids(copy)) == ALL

    old = {k: v for k, v in state.items() if k != "store_id"} | {"version": 1}
    resumed = HiddenStatesIterable(a_url)
    with pytest.raises(ValueError, match=r"version 1 names no store") as refused:
        resumed.load_state_dict(old)
    assert f"'store_id': '{state['store_id']}'" in str(refused.value)
    resumed.load_state_dict({**old, "version": 2, "store_id": resumed.store_id})
    assert sorted(before + ids(resumed)) == ALL


def test_a_reader_whose_store_is_replaced_before_it_reads_refuses_it(tmp_path: Path) -> None:
    """Not following: a reader made on store A and read after B replaced it raises: the
    iterable as its iteration starts, the random-access one in a copy pickled without its
    store handle (as a DataLoader worker gets it), which opens the store afresh."""
    url = tmp_path / "s.zarr"
    store = new_store(url)
    write_shard(store, 0)
    here, copied = HiddenStatesIterable(str(url)), HiddenStatesDataset(str(url))
    replace_store(url, same_plan=False)
    with pytest.raises(StoreReplaced, match="store_id"):
        next(iter(here))
    with pytest.raises(StoreReplaced, match="store_id"):
        pickle.loads(pickle.dumps(copied))[0]


@pytest.mark.parametrize("prefetch_bytes", [1, None], ids=["next-block-ahead", "all-read-ahead"])
@pytest.mark.parametrize("same_plan", [False, True], ids=["another-plan", "same-plan"])
def test_a_read_yields_no_row_of_a_store_replaced_under_it(
    tmp_path: Path, prefetch_bytes: int | None, same_plan: bool
) -> None:
    """A reader in the middle of store A (one sample a block; the next block read ahead, or
    every block) with no poll due for long: B made at its URL stops it at the very next sample,
    naming both, before any row read since is yielded (B's own layout: every later sample
    would be read wrong)."""
    url = tmp_path / "s.zarr"
    store = new_store(url)
    for k in range(3):
        write_shard(store, k)
    a = store_id(url)
    reader = HiddenStatesIterable(
        str(url), block_bytes=1, prefetch_bytes=prefetch_bytes, poll_s=60, max_poll_s=60
    )
    samples = iter(reader)
    assert_sample_exact(next(samples), 0, "bfloat16")
    b = replace_store(url, same_plan).group.attrs["store_id"]
    said = rf"store_id {a} when first read, store_id {b} there now"
    with pytest.raises(StoreReplaced, match=said):
        next(samples)


def test_random_access_yields_no_row_of_a_store_replaced_under_it(tmp_path: Path) -> None:
    """Random access in this process (a DataLoader of no workers): item 0 read from store A,
    then B made at its URL: every later item raises, naming both, where it read B's rows with
    A's layout."""
    url = tmp_path / "s.zarr"
    store = new_store(url)
    for k in range(3):
        write_shard(store, k)
    a, ds = store_id(url), HiddenStatesDataset(str(url))
    assert_sample_exact(ds[0], 0, "bfloat16")
    b = replace_store(url, same_plan=False).group.attrs["store_id"]
    for k in (0, 1, 5, 9):
        with pytest.raises(StoreReplaced, match=f"store_id {a} when first read, store_id {b}"):
            ds[k]


def test_the_stores_own_attribute_writes_do_not_stop_its_readers(tmp_path: Path) -> None:
    """Store A's zarr.json written again mid-read (its job writes a report): the readers see it
    changed, read it, find A's store_id still, and read on, every sample exact."""
    url = tmp_path / "s.zarr"
    store = new_store(url)
    for k in range(3):
        write_shard(store, k)
    samples = iter(HiddenStatesIterable(str(url), block_bytes=1, prefetch_bytes=1))
    ds = HiddenStatesDataset(str(url))
    assert_sample_exact(next(samples), 0, "bfloat16")
    assert_sample_exact(ds[0], 0, "bfloat16")
    before = fingerprint(LocalStore(url))
    store.group.attrs["report"] = {"ok": True}
    assert fingerprint(LocalStore(url)) != before
    for i, sample in enumerate(samples, start=1):
        assert_sample_exact(sample, i, "bfloat16")
        assert_sample_exact(ds[i], i, "bfloat16")
    assert i == len(ALL) - 1


@pytest.mark.parametrize(
    "when,kept", [("export: note:", 0), ("4/4 samples", 4)], ids=["before-reading", "after-shard-0"]
)
def test_export_follow_stops_when_its_store_is_replaced_keeping_only_its_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, when: str, kept: int
) -> None:
    """Store A exported as it commits; store B replaces A once the export has opened A (its
    notes said, its reader not made yet) or once shard 0's files are written (progress said
    after each sample here): the export stops, naming both, with no file of B's."""
    url, out = tmp_path / "s.zarr", tmp_path / "followed"
    store = new_store(url)
    write_shard(store, 0)
    a, made = store_id(url), []
    monkeypatch.setattr("hsx_store.export.run.PROGRESS_EVERY_S", 0.0)

    def say(text: str) -> None:
        if when in text and not made:
            made.append(replace_store(url, same_plan=False).group.attrs["store_id"])

    with pytest.raises(StoreReplaced, match=f"store_id {a} when first read") as stopped:
        export(str(url), out, "specforge", follow=True, poll_s=0.02, idle_timeout_s=10, say=say)
    assert f"store_id {made[0]} there now" in str(stopped.value)
    assert sorted(p.name for p in out.rglob("*.ckpt")) == [f"data_{i}.ckpt" for i in range(kept)]
    assert json.loads((out / "export.json").read_text())["store_id"] == a


def test_export_follow_waiting_for_a_plan_stops_when_the_store_is_replaced(
    tmp_path: Path,
) -> None:
    url, out = tmp_path / "s.zarr", tmp_path / "followed"
    planning_store(url)
    a, made = store_id(url), []

    def say(text: str) -> None:  # said before the first poll of the plan
        made.append(replace_store(url, same_plan=False).group.attrs["store_id"])

    with pytest.raises(StoreReplaced, match=f"store_id {a} when first read") as stopped:
        export(str(url), out, "speculators", follow=True, poll_s=0.02, say=say)
    assert f"store_id {made[0]} there now" in str(stopped.value) and not out.exists()
