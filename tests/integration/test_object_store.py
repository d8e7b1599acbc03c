"""The store on object storage, against a real S3 server on loopback (moto): created, written,
committed, fenced, read, verified and exported exactly as a local store, and refused clearly
where the location cannot be used."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import obstore.exceptions
import pytest
import zarr
from torch.utils.data import DataLoader

from actors.lease_keeper import LeaseLost
from actors.ports import free_port
from actors.shard_writer import ShardWriter
from cluster.__main__ import main
from cluster.config import parse_config
from cluster.job_store import open_or_create, plan_into
from cluster.shard_queue import ShardQueue
from hsx_store.export.registry import FORMATS
from hsx_store.format import Store
from hsx_store.generated import GeneratedParts
from hsx_store.integrity import verify_store
from hsx_store.location import (
    SinglePutObjectStore,
    StoreAccessError,
    ThrottleTally,
    open_location,
)
from hsx_store.object_rows import _ChunkSource
from hsx_store.reader import HiddenStatesDataset, HiddenStatesIterable, token_arrays
from tests.helpers.exports import assert_same, export, exported_files
from tests.helpers.jobs import job_config
from tests.helpers.prompts import write_prompts
from tests.helpers.reports import errors
from tests.helpers.synthetic import (
    as_input,
    build_store,
    keeper,
    new_store,
    other_bits,
    partly_written_store,
    plan,
    sample_bits,
)
from tests.helpers.throttling import WRITE_RATE, through
from tools.s3_server import S3Server
from tools.throttling_proxy import ThrottlingProxy


def fresh_url(s3: S3Server) -> tuple[str, str]:
    prefix = f"{uuid.uuid4().hex}/s.zarr"
    return s3.url(prefix), prefix


def test_a_store_on_s3_reads_verifies_and_exports_as_the_same_store_on_disk(
    s3: S3Server, tmp_path: Path
) -> None:
    local = str(build_store(tmp_path / "local.zarr"))
    url, prefix = fresh_url(s3)
    build_store(url, storage_options=s3.options)
    keys = s3.keys(prefix)
    assert f"{prefix}/zarr.json" in keys and f"{prefix}/aux_hidden_states/c/5/0/0" in keys

    want = HiddenStatesDataset(local)
    got = HiddenStatesDataset(url, storage_options=s3.options)
    assert len(got) == len(want) > 0
    for i in range(len(want)):
        assert_same(got[i], want[i])
    iterable = HiddenStatesIterable(url, storage_options=s3.options)
    spawned = DataLoader(iterable, batch_size=None, num_workers=2, multiprocessing_context="spawn")
    ids = sorted(want[i]["sample_id"] for i in range(len(want)))
    assert sorted(s["sample_id"] for s in spawned) == ids
    forked = DataLoader(iterable, batch_size=None, num_workers=1, multiprocessing_context="fork")
    with pytest.raises(RuntimeError, match="multiprocessing_context='spawn'"):
        next(iter(forked))

    report = verify_store(url, storage_options=s3.options, say=lambda _: None)
    assert report.ok, report.format()
    assert report.checked["chunk_listing"] and report.checked["chunks_checked"] > 0

    for fmt in FORMATS:
        export(local, tmp_path / f"local-{fmt}", fmt, say=lambda _: None)
        export(url, tmp_path / f"s3-{fmt}", fmt, storage_options=s3.options, say=lambda _: None)
        mine = exported_files(tmp_path / f"s3-{fmt}", fmt)
        theirs = exported_files(tmp_path / f"local-{fmt}", fmt)
        assert [p.name for p in mine] == [p.name for p in theirs] and mine
        for a, b in zip(mine, theirs, strict=True):
            assert a.read_bytes() == b.read_bytes(), a.name

    # A chunk object lost on S3 is found through the bucket's listing.
    s3.client().delete_object(Bucket=s3.bucket, Key=f"{prefix}/aux_hidden_states/c/5/0/0")
    report = verify_store(url, storage_options=s3.options, say=lambda _: None)
    assert errors(report, "chunks")[0].startswith("aux_hidden_states: chunk 5 (key ")
    assert s3.secret_access_key not in report.format()


def test_every_chunk_is_one_put(s3: S3Server) -> None:
    location = open_location(s3.url("one-put.zarr"), s3.options)
    assert isinstance(location, SinglePutObjectStore)
    arr = zarr.create_array(location, shape=(4, 3 << 20), chunks=(1, 3 << 20), dtype="uint16")
    arr[:] = 7  # 6 MiB chunks: multipart above 5 MiB would leave upload parts behind on failure
    assert len([k for k in s3.keys("one-put.zarr/c/")]) == 4
    assert (arr[:] == 7).all()


class HeldPuts(zarr.storage.WrapperStore):
    """A client whose chunk PUTs hang until released: a stale holder's in-flight write."""

    def __init__(self, store, hold: threading.Event, started: threading.Event) -> None:
        super().__init__(store)
        self.hold, self.started = hold, started

    async def set(self, key, value) -> None:
        if "/c/" in key:
            self.started.set()
            while not self.hold.is_set():
                await asyncio.sleep(0.01)
        await self._store.set(key, value)


def test_a_stale_holders_late_put_cannot_land_after_the_winners_commit(
    s3: S3Server, tmp_path: Path
) -> None:
    url, _ = fresh_url(s3)
    store = new_store(url, storage_options=s3.options)
    queue = ShardQueue([1], straggler_min_seconds=0)
    sh = store.shards[1]
    release, in_flight = threading.Event(), threading.Event()
    stale_view = Store(
        zarr.open_group(HeldPuts(open_location(url, s3.options), release, in_flight), mode="r+"),
        store.manifest,
        store.shards,
        store.sample_start,
        store.sample_length,
    )
    stale_fence = keeper(queue, "stale")
    stale = ShardWriter(stale_view, sh, threads=1, fence=stale_fence)
    # Sample 5 alone fills chunk 5: its PUT starts, inside the fence, and hangs.
    stale.write_sample(5, *(as_input(x, 5) for x in sample_bits(5)))
    assert in_flight.wait(10)
    queue._durations.append(0.0)  # a known shard time: the stale holder counts as a straggler
    winner_fence = keeper(queue, "winner")
    assert winner_fence.lease.deferred
    winner = ShardWriter(store, sh, threads=1, fence=winner_fence, spill_dir=tmp_path / "spill")
    for i in range(sh.sample_begin, sh.sample_end):
        winner.write_sample(i, *(as_input(x, i) for x in other_bits(i)))

    committed = threading.Event()
    thread = threading.Thread(
        target=lambda: (winner.commit({"worker": "winner"}), committed.set()), daemon=True
    )
    thread.start()
    # The winner's claim waits while the stale PUT is in flight: it cannot land after the commit.
    assert not committed.wait(1.5)
    assert not store.committed()[1]
    release.set()
    thread.join(30)
    assert committed.is_set() and store.committed()[1]
    with pytest.raises(LeaseLost):  # the stale holder is fenced off from here on
        for i in (4, 6, 7):
            stale.write_sample(i, *(as_input(x, i) for x in sample_bits(i)))
        stale.commit({"worker": "stale"})
    reopened = Store.open(url, storage_options=s3.options)
    for i in range(sh.sample_begin, sh.sample_end):
        aux, final = other_bits(i)
        rows = reopened.sample_rows(i)
        np.testing.assert_array_equal(reopened.group["aux_hidden_states"][rows], aux)
        np.testing.assert_array_equal(reopened.group["final_hidden_states"][rows], final)
    assert reopened.summary(1)["worker"] == "winner"


def test_unusable_locations_are_refused_naming_the_url_and_nothing_is_written(
    s3: S3Server, tmp_path: Path
) -> None:
    before = s3.keys()
    unreachable = {**s3.options, "endpoint": f"http://127.0.0.1:{free_port()}"}
    wrong_secret = {**s3.options, "secret_access_key": f"wrong-{s3.secret_access_key}"}
    unknown_key = {**s3.options, "access_key_id": "AKIAUNKNOWN000000000"}
    for url, options, reason in (
        ("s3://no-such-bucket/s.zarr", s3.options, "NoSuchBucket"),
        (s3.url("s.zarr"), unreachable, "error sending request"),
        (s3.url("s.zarr"), wrong_secret, "SignatureDoesNotMatch"),
        (s3.url("s.zarr"), unknown_key, "InvalidAccessKeyId"),
    ):
        with pytest.raises(StoreAccessError) as caught:
            new_store(url, storage_options=options)
        message = str(caught.value)
        assert message.startswith(f"{url}: ") and reason in message, message
        assert s3.secret_access_key not in message, message
        with pytest.raises(StoreAccessError, match=f"^{url}: "):
            Store.open(url, storage_options=options)
    assert s3.keys() == before

    s3.client().put_object(Bucket=s3.bucket, Key="other/notes.txt", Body=b"not a store")
    with pytest.raises(StoreAccessError, match=r"other: not empty .*'notes.txt'"):
        new_store(s3.url("other"), storage_options=s3.options)
    assert s3.keys("other") == ["other/notes.txt"]


# Runs `python -m cluster` for each argv in argv[1] (a JSON list), in this one process; prints
# [[exit status, everything printed], ...].
EACH_COMMAND = """
import contextlib, io, json, logging, sys
from cluster.__main__ import main
results = []
for argv in json.loads(sys.argv[1]):
    out = io.StringIO()
    logging.root.handlers.clear()  # what a command logs goes to its own output
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        status = main(argv)
    results.append([status, out.getvalue()])
print(json.dumps(results))
"""


def test_every_command_exits_2_on_an_unusable_location_naming_the_url_without_secrets(
    s3: S3Server, deepseek_path: Path, tmp_path: Path
) -> None:
    """`run`, `verify` and `export`, configured as a node is (the `AWS_*` environment): a bucket
    that does not exist, refused credentials, no endpoint, a prefix holding something else."""
    s3.client().put_object(Bucket=s3.bucket, Key="taken/notes.txt", Body=b"not a store")
    before = s3.keys()
    write_prompts(tmp_path / "prompts.jsonl", 3)
    config = job_config(deepseek_path, tmp_path / "prompts.jsonl", tmp_path / "unused", tmp_path)
    config["queue"]["lease_s"] = 300  # beyond the margin object storage needs (its write bound)
    (tmp_path / "job.yaml").write_text(json.dumps(config))  # JSON is YAML
    good = s3.environment
    cases = {
        "no bucket": ("s3://no-such-bucket/s.zarr", good, "NoSuchBucket"),
        "wrong secret": (
            s3.url("s.zarr"),
            {**good, "AWS_SECRET_ACCESS_KEY": f"wrong-{s3.secret_access_key}"},
            "SignatureDoesNotMatch",
        ),
        "no endpoint": (
            s3.url("s.zarr"),
            {**good, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{free_port()}"},
            "error sending request",
        ),
        "taken prefix": (s3.url("taken"), good, ""),
    }
    commands = {
        "run": ["run", "--config", str(tmp_path / "job.yaml"), "--store"],
        "verify": ["verify", "--store"],
        "export": ["export", "--format", "specforge", "--out", str(tmp_path / "x"), "--store"],
    }
    base_env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    # A process per location (its environment), running the three commands one after another.
    running = {
        case: subprocess.Popen(
            [
                sys.executable,
                "-c",
                EACH_COMMAND,
                json.dumps([[*argv, url] for argv in commands.values()]),
            ],
            env={**base_env, **env},
            stdout=subprocess.PIPE,
            text=True,
        )
        for case, (url, env, _) in cases.items()
    }
    for case, process in running.items():
        out, _ = process.communicate(timeout=300)
        url, env, reason = cases[case]
        assert process.returncode == 0, (case, out)
        for command, (status, output) in zip(commands, json.loads(out), strict=True):
            assert status == 2, (case, command, output)
            assert f"{url}: " in output and reason in output, (case, command, output)
            assert env["AWS_SECRET_ACCESS_KEY"] not in output, (case, command)
    assert s3.keys() == before  # nothing written anywhere


def test_dry_run_finds_an_s3_store_as_run_would_and_puts_nothing(
    s3: S3Server,
    deepseek_path: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With the node's `AWS_*` settings: a fresh prefix takes a new store, the job's own store
    on S3 is resumed (exit 0); another job's store, and a wrong secret, are each a problem
    naming the URL and why, never the secret (exit 2)."""
    write_prompts(tmp_path / "prompts.jsonl", 3)
    url, prefix = fresh_url(s3)
    raw = job_config(deepseek_path, tmp_path / "prompts.jsonl", url, tmp_path)
    raw["queue"]["lease_s"] = 300  # beyond the margin object storage needs (its write bound)
    (tmp_path / "job.yaml").write_text(json.dumps(raw))  # JSON is YAML
    for name, value in s3.environment.items():
        monkeypatch.setenv(name, value)
    dry_run = ["run", "--config", str(tmp_path / "job.yaml"), "--dry-run"]
    assert main(dry_run) == 0
    assert f"store: none at {url} yet: `run` makes it there" in capsys.readouterr().out
    assert s3.keys(prefix) == []

    config = parse_config(raw)
    _, _, builder = open_or_create(config, say=lambda _: None)
    plan_into(builder, config, 0, lambda shards: None)
    before = s3.keys()
    assert main(dry_run) == 0
    assert f"store: {url} is this job's, 0/1 shards committed" in capsys.readouterr().out
    assert main([*dry_run, "--set", "store.samples_per_shard=2"]) == 2
    out = capsys.readouterr().out
    assert f"problem: store.url: {url} was made by a different job" in out
    assert "samples_per_shard: store 3 != config 2" in out
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", f"wrong-{s3.secret_access_key}")
    assert main(dry_run) == 2
    out = capsys.readouterr().out
    assert f"problem: store.url: {url}: " in out and "SignatureDoesNotMatch" in out
    assert s3.secret_access_key not in out
    assert s3.keys() == before


@pytest.mark.parametrize("codec", ["none", "zstd"])
def test_remote_reads_equal_local_reads_lost_and_never_written_chunks_included(
    s3: S3Server, tmp_path: Path, codec: str
) -> None:
    """Chunks fetched whole and ahead (raw GETs for codec none, zarr for zstd) give the local
    store's samples, for blocks of one sample, a few, or whole shards, and any prefetch depth."""
    local = tmp_path / "local.zarr"
    url, prefix = fresh_url(s3)
    partly_written_store(local, codec=codec)
    partly_written_store(url, codec=codec, storage_options=s3.options)
    # Lost on both sides (sample 2's rows 8..15): read as the fill value, as zarr reads it.
    (local / "aux_hidden_states" / "c" / "1" / "0" / "0").unlink()
    s3.client().delete_object(Bucket=s3.bucket, Key=f"{prefix}/aux_hidden_states/c/1/0/0")

    want_ds, got_ds = (
        HiddenStatesDataset(str(local)),
        HiddenStatesDataset(url, storage_options=s3.options),
    )
    assert len(got_ds) == len(want_ds) > 0
    for k in range(len(want_ds)):
        assert_same(got_ds[k], want_ds[k])
    for block_bytes, prefetch_bytes in ((1, 0), (1, 1 << 30), (1000, 1), (1 << 30, 0)):
        want = list(HiddenStatesIterable(str(local), block_bytes=block_bytes))
        got = HiddenStatesIterable(
            url, storage_options=s3.options, block_bytes=block_bytes, prefetch_bytes=prefetch_bytes
        )
        got = list(got)
        assert len(got) == len(want) == len(want_ds)
        for a, b in zip(got, want, strict=True):
            assert_same(a, b)
    raw = HiddenStatesIterable(url, storage_options=s3.options)._view.rows
    assert all(source.raw == (codec == "none") for source in raw.sources.values())


def test_remote_chunks_are_fetched_once_each_ahead_of_the_consumer_within_the_budget(
    s3: S3Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    url, _ = fresh_url(s3)
    store, _ = partly_written_store(url, storage_options=s3.options)
    fetched: list[tuple[str, int]] = []
    original = _ChunkSource.fetch

    async def recorded(self: _ChunkSource, k: int) -> np.ndarray | None:
        fetched.append((self.array.path, k))
        return await original(self, k)

    monkeypatch.setattr(_ChunkSource, "fetch", recorded)
    chunk_sets = lambda: sorted({k for _, k in fetched})  # noqa: E731
    # One sample per block, no byte budget: the next block only is fetched ahead.
    it = iter(
        HiddenStatesIterable(url, storage_options=s3.options, block_bytes=1, prefetch_bytes=0)
    )
    first = next(it)  # sample 0: rows 0..4 (chunk 0); sample 1 (row 5, chunk 0) is next
    assert first["sample_id"] == plan()[0][0]
    time.sleep(0.5)
    assert chunk_sets() == [0]
    next(it), next(it)  # sample 2 (rows 6..18: chunks 0-2) in hand: sample 3's (18..26) ahead
    time.sleep(0.5)
    assert chunk_sets() == [0, 1, 2, 3]
    del it  # stopped early: nothing is left fetching or waiting
    # Read to the end: every chunk a visible sample touches, fetched exactly once per array.
    fetched.clear()
    samples = list(HiddenStatesIterable(url, storage_options=s3.options, block_bytes=1))
    assert len(fetched) == len(set(fetched))
    rows = (store.sample_rows(plan()[0].index(s["sample_id"])) for s in samples)
    c = store.manifest.chunk_tokens
    touched = {k for r in rows for k in range(r.start // c, -(-r.stop // c))}
    assert sorted(fetched) == sorted(
        (name, k) for name in token_arrays(store.manifest) for k in touched
    )


# -- throttling: S3's 503 SlowDown above a prefix's request rate -------------------------------


def test_throttled_puts_are_retried_until_each_lands_once_and_are_counted(s3: S3Server) -> None:
    prefix = f"{uuid.uuid4().hex}/t"
    objects = {f"o{i}": np.random.default_rng(i).bytes(4096) for i in range(40)}
    tally = ThrottleTally()
    with ThrottlingProxy(s3.endpoint, write_rate=WRITE_RATE) as proxy:
        location = open_location(s3.url(prefix), through(proxy, s3))

        def put(key: str) -> None:  # on a pool thread: the tally counts there too
            with tally.counting():
                location.put_parts(key, [memoryview(objects[key])])

        with ThreadPoolExecutor(4) as pool:
            list(pool.map(put, objects))
        with tally.counting():  # zarr's own PUTs (metadata, chunks), on its event loop
            array = zarr.create_array(location, name="a", shape=(20,), chunks=(1,), dtype="uint8")
            array[:] = np.arange(1, 21, dtype="uint8")  # no chunk of fill values: all PUTs
    assert proxy.throttled["PUT"] > 0
    assert tally.count == proxy.throttled["PUT"]  # each SlowDown answer retried and counted
    # Every object once, as written: each PUT the server got made one object, none twice.
    keys = s3.keys(prefix)
    assert proxy.passed["PUT"] == len(keys) == len(set(keys)) == len(objects) + 20 + 2
    client = s3.client()
    for key, data in objects.items():
        got = client.get_object(Bucket=s3.bucket, Key=f"{prefix}/{key}")["Body"].read()
        assert got == data, key
    assert (
        zarr.open_array(open_location(s3.url(prefix), s3.options), path="a")[:] == range(1, 21)
    ).all()
    # The clients kept the endpoint near its rate while they were throttled.
    rate = proxy.write_rate_while_throttling()
    assert 0.5 * WRITE_RATE < rate <= 1.1 * WRITE_RATE, rate


def test_a_create_only_put_is_retried_when_throttled_and_never_replaces_the_first(
    s3: S3Server,
) -> None:
    """A part's responses are written create-only (hsx_store/generated.py): throttled, each
    create is retried until it lands, a second one leaves the first, and neither fails."""
    prefix = f"{uuid.uuid4().hex}/g"
    tally = ThrottleTally()
    with ThrottlingProxy(s3.endpoint, write_rate=WRITE_RATE) as proxy:
        parts = GeneratedParts(open_location(s3.url(prefix), through(proxy, s3)))
        with tally.counting():
            for part in range(2 * WRITE_RATE):
                parts.put_responses(part, {"samples": [], "worker": "first"})
            for part in range(2 * WRITE_RATE):
                parts.put_responses(part, {"samples": [], "worker": "second"})
    assert tally.count == proxy.throttled["PUT"] > 0
    stored = GeneratedParts(open_location(s3.url(prefix), s3.options))
    assert stored.parts() == list(range(2 * WRITE_RATE))
    for part in range(2 * WRITE_RATE):
        assert stored.responses(part)["worker"] == "first"


def test_a_throttled_put_not_retried_fails_naming_slow_down_and_its_object_is_missing(
    s3: S3Server,
) -> None:
    """What the test above would catch: with no time to retry (retry_timeout 0), the first
    SlowDown answer fails the PUT, and the object is not there."""
    prefix = f"{uuid.uuid4().hex}/t"
    failed: dict[str, BaseException] = {}
    with ThrottlingProxy(s3.endpoint, write_rate=WRITE_RATE) as proxy:
        location = open_location(s3.url(prefix), through(proxy, s3, retry_timeout=0))
        for i in range(2 * WRITE_RATE):
            try:
                location.put_parts(f"o{i}", [memoryview(b"x" * 100)])
            except obstore.exceptions.GenericError as exc:
                failed[f"o{i}"] = exc
    assert len(failed) == proxy.throttled["PUT"] > 0
    error = next(iter(failed.values()))
    assert "503 Service Unavailable" in str(error) and "<Code>SlowDown</Code>" in str(error)
    assert error.__notes__ == [
        "1 throttled answers (503 SlowDown or 429) retried over 0.0 s; "
        "retry_config.retry_timeout is 0 s"
    ]
    stored = {key.rsplit("/", 1)[1] for key in s3.keys(prefix)}
    assert stored == {f"o{i}" for i in range(2 * WRITE_RATE)} - set(failed)
