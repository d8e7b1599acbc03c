"""The Zarr store and its shard writer: layout, bit-exact round trip, failures, leases, resume."""

from __future__ import annotations

import stat
import threading
import time
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import zarr

from actors.lease_keeper import LeaseLost
from actors.shard_writer import ShardWriter
from cluster.shard_queue import ShardQueue
from hsx_store.builder import PlanDiverged, StoreBuilder, create_store
from hsx_store.format import (
    BF16_ATTR,
    SCHEMA_VERSION,
    Manifest,
    Store,
    StoreFormatError,
    StoreIncomplete,
    layout,
    make_manifest,
)
from hsx_store.integrity import verify_store
from hsx_store.location import StoreAccessError
from tests.helpers.synthetic import (
    CHUNK,
    LENGTHS,
    NUM_AUX,
    PER_SHARD,
    H,
    as_input,
    check_rows,
    keeper,
    manifest,
    new_store,
    other_bits,
    plan,
    sample_bits,
    write_shard,
)


@pytest.mark.parametrize("per_shard,chunk", [(1, 1), (3, 8), (4, 7), (50, 16)])
def test_layout_is_chunk_aligned_packed_and_deterministic(per_shard: int, chunk: int) -> None:
    lengths = np.random.default_rng(per_shard).integers(1, 40, 37)
    starts, shards, total = layout(lengths, per_shard, chunk)
    again = layout(lengths.tolist(), per_shard, chunk)
    assert np.array_equal(starts, again[0]) and shards == again[1] and total == again[2]
    assert [s.sample_begin for s in shards] == list(range(0, 37, per_shard))
    assert shards[-1].sample_end == 37
    for prev, sh in zip([None, *shards], shards, strict=False):
        assert sh.token_begin % chunk == 0
        if prev is not None:  # the next chunk boundary after the previous shard: no overlap
            assert sh.token_begin == -(-prev.token_end // chunk) * chunk
        ends = starts[sh.sample_begin : sh.sample_end] + lengths[sh.sample_begin : sh.sample_end]
        assert starts[sh.sample_begin] == sh.token_begin and ends[-1] == sh.token_end
        assert np.array_equal(starts[sh.sample_begin + 1 : sh.sample_end], ends[:-1])  # packed
    assert total % chunk == 0 and total - chunk < shards[-1].token_end <= total
    with pytest.raises(ValueError, match="sample 1 has no tokens"):
        layout([3, 0], per_shard, chunk)


@pytest.mark.parametrize("dtype,codec", [("bfloat16", "zstd"), ("float32", "none")])
def test_out_of_order_writes_read_back_bit_exact(tmp_path: Path, dtype: str, codec: str) -> None:
    c = {"name": "zstd", "level": 1} if codec == "zstd" else {"name": "none"}
    store = new_store(tmp_path / "s.zarr", dtype, c)
    rng = np.random.default_rng(1)
    for k in reversed(range(len(store.shards))):
        sh = store.shards[k]
        summary = write_shard(
            store, k, rng.permutation(range(sh.sample_begin, sh.sample_end)).tolist()
        )
        assert summary["written"] == sh.sample_end - sh.sample_begin and summary["failed"] == {}
        payload = sum(LENGTHS[sh.sample_begin : sh.sample_end]) * (NUM_AUX + 1) * H
        assert summary["bytes_written"] == payload * (2 if dtype == "bfloat16" else 4)

    store = Store.open(tmp_path / "s.zarr")
    g = store.group
    assert store.manifest == manifest(dtype, c) and store.num_samples == len(LENGTHS)
    assert store.committed().all() and (g["sample_status"][:] == 1).all()
    assert store.rejected == [{"sample_id": "bad", "reason": "too long"}]
    assert g["sample_id"][3] == "s3-é" and g["sample_length"][2] == 13
    assert store.summary(1)["worker"] == "w1"
    check_rows(store, list(range(len(LENGTHS))))
    if dtype == "bfloat16":
        assert dict(g["aux_hidden_states"].attrs) == BF16_ATTR
        bf16 = g["final_hidden_states"][store.sample_rows(0)].view(ml_dtypes.bfloat16)
        assert np.isnan(bf16.astype(np.float32)).any() and np.isinf(bf16.astype(np.float32)).any()
    # Padding between shards reads back as zero; the plan's rows are the driver's.
    gap = slice(store.shards[0].token_end, store.shards[1].token_begin)
    assert gap.stop > gap.start and not g["final_hidden_states"][gap].any()
    assert not g["input_ids"][gap].any()
    for i, (name, ids, mask) in enumerate(zip(*plan(), strict=True)):
        assert g["sample_id"][i] == name
        assert np.array_equal(g["input_ids"][store.sample_rows(i)], ids)
        assert np.array_equal(g["loss_mask"][store.sample_rows(i)], mask)


def test_wrong_length_is_refused_naming_the_sample(tmp_path: Path) -> None:
    store = new_store(tmp_path / "s.zarr")
    writer = ShardWriter(store, store.shards[0])
    aux, final = sample_bits(2)
    with pytest.raises(ValueError, match=r"sample 2 \(s2-é\).*expected 13 rows"):
        writer.write_sample(2, as_input(aux[:-1], 0), as_input(final[:-1], 0))
    with pytest.raises(ValueError, match=r"sample 2 \(s2-é\) final: dtype float32"):
        writer.write_sample(2, as_input(aux, 0), final.astype(np.float32))
    with pytest.raises(ValueError, match=r"sample 2 \(s2-é\): got 3 hidden arrays, the store"):
        writer.write_sample(2, as_input(aux, 0), as_input(final, 0), as_input(final, 0))
    with pytest.raises(ValueError, match="not written"):
        writer.commit({})
    writer.abort()


def test_mark_failed_leaves_zero_rows_and_a_reason(tmp_path: Path) -> None:
    store = new_store(tmp_path / "s.zarr")
    sh = store.shards[1]
    summary = write_shard(store, 1, failed={5: "token ids differ from the plan"})
    assert summary["failed"] == {"s5-é": "token ids differ from the plan"}
    assert summary["written"] == 3
    g = store.group
    assert g["sample_status"][sh.sample_begin : sh.sample_end].tolist() == [1, 2, 1, 1]
    assert not g["aux_hidden_states"][store.sample_rows(5)].any()
    check_rows(store, [4, 6, 7])
    assert store.summary(1)["failed"] == summary["failed"]
    assert store.committed().tolist() == [False, True, False]


def test_lost_lease_stops_writes_and_commit(tmp_path: Path) -> None:
    store = new_store(tmp_path / "s.zarr")
    queue = ShardQueue([1])
    fence = keeper(queue, "w1")
    sh = store.shards[1]  # samples 4..7, lengths 3 20 2 7: rows 32..64, chunks 4..7
    writer = ShardWriter(store, sh, threads=1, fence=fence)
    for i in (4, 5):
        writer.write_sample(i, *(as_input(x, i) for x in sample_bits(i)))
    queue.revoke(1)
    fence.renew()  # the holder learns it at its next heartbeat
    with pytest.raises(LeaseLost):  # raised at once or at the latest by commit
        for i in (6, 7):
            writer.write_sample(i, *(as_input(x, i) for x in sample_bits(i)))
        writer.commit({})
    with pytest.raises(LeaseLost):
        writer.commit({})
    g = store.group
    for i in (6, 7):
        assert not g["aux_hidden_states"][store.sample_rows(i)].any()
        assert not g["final_hidden_states"][store.sample_rows(i)].any()
    assert not store.committed().any() and store.summary(1) is None
    assert not g["sample_status"][:].any()


def test_a_deferred_duplicate_that_claims_first_is_the_only_one_visible(tmp_path: Path) -> None:
    store = new_store(tmp_path / "s.zarr")
    queue = ShardQueue([1], straggler_min_seconds=0)
    sh = store.shards[1]
    slow_fence = keeper(queue, "slow")
    # max_lent_bytes=0: its rows in the chunks shared with samples 4 and 6 are copied out, so
    # on_release comes once chunk 5, written from its memory, is in the store.
    slow = ShardWriter(store, sh, threads=1, fence=slow_fence, max_lent_bytes=0)
    written = threading.Event()  # sample 5 alone fills chunk 6: it is written from its memory
    slow.write_sample(5, *(as_input(x, 5) for x in sample_bits(5)), on_release=written.set)
    assert written.wait(10)
    # Let the queue know a shard time, so the slow one counts as a straggler.
    queue._durations.append(0.0)
    dup_fence = keeper(queue, "fast")
    assert dup_fence.lease.deferred and dup_fence.lease.shard == 1
    dup = ShardWriter(store, sh, threads=1, fence=dup_fence, spill_dir=tmp_path / "spill")
    for i in range(sh.sample_begin, sh.sample_end):
        dup.write_sample(i, *(as_input(x, i) for x in other_bits(i)))
    # Sample 5 (rows 35..55) alone fills chunk 5 (rows 40..48): the original wrote it in place;
    # nothing of the duplicate has reached the store yet.
    in_place = store.group["final_hidden_states"][40:48]
    assert np.array_equal(in_place, sample_bits(5)[1][5:13])
    summary = dup.commit({"worker": "fast"})
    assert queue.complete(dup_fence.lease.lease_id, summary)
    assert not (tmp_path / "spill").exists()
    with pytest.raises(LeaseLost):  # the slow original wakes up: fenced off
        for i in (4, 6, 7):
            slow.write_sample(i, *(as_input(x, i) for x in sample_bits(i)))
        slow.commit({"worker": "slow"})
    g = store.group
    for i in range(sh.sample_begin, sh.sample_end):
        aux, final = other_bits(i)
        np.testing.assert_array_equal(g["aux_hidden_states"][store.sample_rows(i)], aux)
        np.testing.assert_array_equal(g["final_hidden_states"][store.sample_rows(i)], final)
    assert store.committed().tolist() == [False, True, False]
    assert store.summary(1)["worker"] == "fast"


def test_a_deferred_duplicate_that_loses_leaves_no_trace(tmp_path: Path) -> None:
    store = new_store(tmp_path / "s.zarr")
    queue = ShardQueue([1], straggler_min_seconds=0)
    sh = store.shards[1]
    orig_fence = keeper(queue, "orig")
    queue._durations.append(0.0)
    dup_fence = keeper(queue, "dup")
    dup = ShardWriter(store, sh, threads=1, fence=dup_fence, spill_dir=tmp_path / "spill")
    for i in range(sh.sample_begin, sh.sample_end):
        dup.write_sample(i, *(as_input(x, i) for x in other_bits(i)))
    # Spilled chunks are the prompts' activations: private to the user.
    spill = tmp_path / "spill"
    deadline = time.monotonic() + 10
    while not list(spill.glob("*.bin")):
        assert time.monotonic() < deadline, "nothing spilled"
        time.sleep(0.01)
    assert stat.S_IMODE(spill.stat().st_mode) == 0o700
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in spill.glob("*.bin"))
    orig = ShardWriter(store, sh, threads=1, fence=orig_fence)
    for i in range(sh.sample_begin, sh.sample_end):
        orig.write_sample(i, *(as_input(x, i) for x in sample_bits(i)))
    assert queue.complete(orig_fence.lease.lease_id, orig.commit({"worker": "orig"}))
    with pytest.raises(LeaseLost, match=r"claimed it first|refused the heartbeat"):
        dup.commit({"worker": "dup"})
    dup.abort()
    check_rows(store, list(range(sh.sample_begin, sh.sample_end)))
    assert store.summary(1)["worker"] == "orig" and not (tmp_path / "spill").exists()


def test_two_writers_on_adjacent_shards_do_not_interfere(tmp_path: Path) -> None:
    store = new_store(tmp_path / "s.zarr")
    errors: list[BaseException] = []

    def run(k: int) -> None:
        try:
            write_shard(Store.open(tmp_path / "s.zarr", mode="r+"), k, threads=2)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=run, args=(k,)) for k in (0, 1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    store = Store.open(tmp_path / "s.zarr")
    assert store.committed().all()
    check_rows(store, list(range(len(LENGTHS))))


def chunk_files(path: Path) -> dict[Path, bytes]:
    files = (path / "aux_hidden_states").rglob("*")
    return {p: p.read_bytes() for p in files if p.is_file() and p.name != "zarr.json"}


def test_rewriting_a_committed_shard_gives_the_same_bits(tmp_path: Path) -> None:
    path = tmp_path / "s.zarr"
    store = new_store(path)
    write_shard(store, 2)
    before = chunk_files(path)
    store = Store.open(path, mode="r+")
    writer = ShardWriter(store, store.shards[2])
    assert not store.committed()[2]  # a re-issued shard is not complete while it is rewritten
    writer.abort()
    write_shard(store, 2)
    assert chunk_files(path) == before
    assert store.committed()[2]
    check_rows(store, list(range(8, 11)))


def test_wrong_schema_version_is_refused_clearly(tmp_path: Path) -> None:
    store = new_store(tmp_path / "s.zarr")
    newer = SCHEMA_VERSION + 1
    store.group.attrs["manifest"] = {**store.manifest.to_json(), "schema_version": newer}
    with pytest.raises(StoreFormatError, match=f"schema version {newer} is not supported"):
        Store.open(tmp_path / "s.zarr")
    with pytest.raises(StoreFormatError, match="unknown \\['extra'\\]"):
        Manifest.from_json({**manifest().to_json(), "extra": 1})
    zarr.create_group(tmp_path / "other.zarr")
    with pytest.raises(StoreFormatError, match="not a hidden-state store"):
        Store.open(tmp_path / "other.zarr")
    with pytest.raises(StoreAccessError, match="not empty"):  # creation never clobbers a store
        new_store(tmp_path / "s.zarr")


def test_a_plan_streams_in_shard_by_shard_and_an_interrupted_one_resumes(tmp_path: Path) -> None:
    names, ids, masks = plan()
    url = tmp_path / "s.zarr"
    builder = StoreBuilder.create(url, manifest())
    assert Store.open(url).shards == []  # created: workers may open it, nothing to do yet
    for i in range(6):  # the driver dies after planning 6 samples: one shard and a half
        builder.add(names[i], ids[i], masks[i])
    assert builder.flush() == layout(LENGTHS[:4], PER_SHARD, CHUNK)[1]
    reader = Store.open(url, mode="r+")
    assert not reader.planned and [sh.index for sh in reader.shards] == [0]
    assert np.array_equal(reader.group["input_ids"][reader.sample_rows(3)], ids[3])
    report = verify_store(url, say=lambda _: None)
    assert report.exit_code == 2 and "its plan is not complete" in report.format()

    # Resumed: planned again from the start; what the store holds is checked, not rewritten.
    with pytest.raises(PlanDiverged, match="shard 0"):
        other = StoreBuilder.resume(Store.open(url, mode="r+"))
        for i in range(4):
            other.add(names[i], ids[i] + 1, masks[i])
        other.finish([])
    resumed = StoreBuilder.resume(Store.open(url, mode="r+"))
    for i in range(len(LENGTHS)):
        resumed.add(names[i], ids[i], masks[i])
    resumed.finish([{"sample_id": "bad", "reason": "too long"}])
    reader.refresh()  # an earlier handle catches up
    fresh = new_store(tmp_path / "fresh.zarr")
    for store in (reader, Store.open(url)):
        assert store.planned and store.shards == fresh.shards
        assert np.array_equal(store.sample_start, fresh.sample_start)
        assert store.rejected == fresh.rejected
        for name in ("input_ids", "loss_mask", "sample_id", "sample_start", "shard_plan_sha256"):
            got, want = store.group[name], fresh.group[name]
            assert got.shape == want.shape and np.array_equal(got[:], want[:]), name
    errors = verify_store(url, say=lambda _: None).findings
    assert {(f.check, f.message.split(":")[0]) for f in errors if f.level == "error"} == {
        ("commits", f"shard {k} not committed") for k in range(3)
    }  # a consistent plan, with nothing captured yet

    # Without `created` (killed while making the arrays) it is never opened as a plan.
    group = zarr.open_group(url, mode="r+")
    group.attrs.put({k: v for k, v in group.attrs.items() if k != "created"})
    with pytest.raises(StoreIncomplete, match="creation was interrupted"):
        Store.open(url, mode="r+")
    with pytest.raises(StoreAccessError, match="not empty"):
        create_store(url, manifest(), names, ids, masks)
    create_store(url, manifest(), names, ids, masks, overwrite=True)
    assert Store.open(url).shards == fresh.shards


def test_make_manifest_hashes_the_model_and_picks_the_chunking(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "tokenizer.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"weights")
    meta = {  # as in a dump's meta.json
        "layer_ids": [2, 30, 58],
        "layer_convention": "HF hidden_states[layer_ids[j]]",
        "hidden_size": 7168,
        "num_aux": 3,
        "dtype": "bfloat16",
    }
    m = make_manifest("kimi", tmp_path, meta, max_length=8192, samples_per_shard=64)
    assert m.model_config_hash == m.tokenizer_hash != "" and m.chat_template_hash is None
    assert m.codec == {"name": "none"} and m.chunk_tokens == 1024  # ~32 MB of aux rows
    assert Manifest.from_json(m.to_json()) == m
    assert m.final_states == ["post_norm", "pre_norm"]
    assert m.hidden_arrays == ("aux_hidden_states", "final_hidden_states", "prenorm_hidden_states")


def test_a_schema_4_manifest_reads_as_post_norm_only_and_writes_back_unchanged() -> None:
    old = {**manifest().to_json(), "schema_version": 4, "final_state": "post_norm"}
    for newer in ("final_states", "image_token_id", "position_ids"):
        del old[newer]
    m = Manifest.from_json(old)
    assert m.final_states == ["post_norm"]
    assert m.hidden_arrays == ("aux_hidden_states", "final_hidden_states")
    assert m.to_json() == old  # compared with stored copies (resume, export): as kept
    with pytest.raises(StoreFormatError, match=r"unknown \['final_states'\]"):
        Manifest.from_json({**old, "final_states": ["post_norm"]})
    with pytest.raises(ValueError, match="final_states must be"):
        Manifest.from_json({**manifest().to_json(), "final_states": ["pre_norm"]})
