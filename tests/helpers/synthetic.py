"""Small synthetic stores for tests without a server: a plan of 11 samples in 3 shards, rows
with NaN/inf/subnormal bit patterns (bit-exact round trips) or finite ones (verify), written
by the real shard writer."""

from __future__ import annotations

import threading
from pathlib import Path

import ml_dtypes
import numpy as np
import torch

from actors.lease_keeper import LeaseKeeper
from actors.shard_writer import ShardWriter
from cluster.shard_queue import ShardQueue
from hsx_store.builder import StoreBuilder, create_store
from hsx_store.format import SCHEMA_VERSION, Manifest, Store

H, NUM_AUX, CHUNK, PER_SHARD = 8, 3, 8, 4


LENGTHS = [5, 1, 13, 8, 3, 20, 2, 7, 9, 16, 4]  # 11 samples: 3 shards, the last one short

SPECIALS = np.array([0x7FC0, 0xFFC1, 0x7F81, 0x7F80, 0xFF80, 0x8000, 0x0001], np.uint16)


def manifest(dtype: str = "bfloat16", codec: dict | None = None) -> Manifest:
    return Manifest(
        schema_version=SCHEMA_VERSION,
        model="tiny",
        model_config_hash="c" * 64,
        tokenizer_hash="t" * 64,
        weights_fingerprint="w" * 64,
        chat_template_hash=None,
        layer_ids=[2, 4, 5],
        layer_convention="HF hidden_states[layer_ids[j]]",
        final_states=["post_norm"],  # aux + one final array: the writer tests' rows
        hidden_size=H,
        num_aux=NUM_AUX,
        dtype=dtype,
        max_length=64,
        codec=codec or {"name": "zstd", "level": 1},
        chunk_tokens=CHUNK,
        samples_per_shard=PER_SHARD,
    )


def plan() -> tuple[list[str], list[np.ndarray], list[np.ndarray]]:
    rng = np.random.default_rng(0)
    ids = [rng.integers(0, 1000, n).astype(np.int32) for n in LENGTHS]
    masks = [rng.integers(0, 2, n).astype(np.uint8) for n in LENGTHS]
    return [f"s{i}-é" for i in range(len(LENGTHS))], ids, masks


def new_store(
    path: Path | str,
    dtype: str = "bfloat16",
    codec: dict | None = None,
    storage_options: dict | None = None,
) -> Store:
    rejected = [{"sample_id": "bad", "reason": "too long"}]
    return create_store(
        path, manifest(dtype, codec), *plan(), rejected=rejected, storage_options=storage_options
    )


def planning_store(path: Path | str, planned: int = 8) -> StoreBuilder:
    """A store whose plan is still being written, as a running driver leaves it: the plan's
    first `planned` samples added and flushed (8: shards 0 and 1, not shard 2). Its builder,
    for `finish_plan`."""
    names, ids, masks = plan()
    builder = StoreBuilder.create(path, manifest())
    for i in range(planned):
        builder.add(names[i], ids[i], masks[i])
    builder.flush()
    return builder


def finish_plan(builder: StoreBuilder) -> None:
    """Add the rest of the plan to a `planning_store` and complete it."""
    names, ids, masks = plan()
    for i in range(builder.store.num_samples, len(names)):
        builder.add(names[i], ids[i], masks[i])
    builder.finish([])


def sample_bits(i: int, dtype: str = "bfloat16") -> tuple[np.ndarray, np.ndarray]:
    """Deterministic raw rows of sample i: random bits with NaN/inf/-0/subnormal patterns."""
    rng = np.random.default_rng(100 + i)
    if dtype == "float32":
        return rng.standard_normal((LENGTHS[i], NUM_AUX, H), np.float32), rng.standard_normal(
            (LENGTHS[i], H), np.float32
        )
    aux = rng.integers(0, 1 << 16, (LENGTHS[i], NUM_AUX, H), dtype=np.uint16)
    final = rng.integers(0, 1 << 16, (LENGTHS[i], H), dtype=np.uint16)
    aux.reshape(-1)[: len(SPECIALS)] = SPECIALS
    final.reshape(-1)[-len(SPECIALS) :] = SPECIALS
    return aux, final


def other_bits(i: int) -> tuple[np.ndarray, np.ndarray]:
    """What another server might capture for sample i: different bits, same shapes."""
    return tuple(~x for x in sample_bits(i))


def as_input(bits: np.ndarray, i: int) -> np.ndarray | torch.Tensor:
    """Alternate the input kinds a worker may hand over: bf16 torch tensors and ml_dtypes arrays."""
    if bits.dtype != np.uint16:
        return torch.from_numpy(bits) if i % 2 else bits
    if i % 2:
        return torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16)
    return bits.view(ml_dtypes.bfloat16)


def write_shard(
    store: Store,
    k: int,
    order: list[int] | None = None,
    failed: dict[int, str] | None = None,
    summary: dict | None = None,
    **kw,
) -> dict:
    """Write and commit shard k: every sample's bits (in `order`), the `failed` ones marked."""
    shard = store.shards[k]
    writer = ShardWriter(store, shard, **kw)
    samples = list(range(shard.sample_begin, shard.sample_end)) if order is None else order
    dtype = store.manifest.dtype
    for i in samples:
        if failed and i in failed:
            writer.mark_failed(i, failed[i])
            continue
        aux, final = sample_bits(i, dtype)
        writer.write_sample(i, as_input(aux, i), as_input(final, i))
    return writer.commit({"worker": f"w{k}", **(summary or {})})


def check_rows(store: Store, samples: list[int]) -> None:
    g = store.group
    for i in samples:
        aux, final = sample_bits(i, store.manifest.dtype)
        rows = store.sample_rows(i)
        np.testing.assert_array_equal(g["aux_hidden_states"][rows], aux)
        np.testing.assert_array_equal(g["final_hidden_states"][rows], final)


def keeper(queue: ShardQueue, worker: str) -> LeaseKeeper:
    """A lease on the in-process queue, fenced exactly as a worker's is through the actor, its
    heartbeat thread running (a revoked holder learns it there and says it stopped)."""
    lease = queue.acquire(worker)
    assert lease is not None
    lock = threading.Lock()  # the actor runs one call at a time; the plain class does not

    def call(method: str, *args: object) -> object:
        with lock:
            return getattr(queue, method)(*args)

    return LeaseKeeper(call, lease, interval=0.05).__enter__()


def partly_written_store(
    path: Path | str,
    dtype: str = "bfloat16",
    codec: str = "none",
    storage_options: dict | None = None,
) -> tuple[Store, list[int]]:
    """Shards 0 and 2 committed (sample 9 failed), shard 1 written in part and never
    committed; returns the visible samples. Uncompressed local chunks are read directly from
    their files, zstd ones through zarr: both paths are tested."""
    store = new_store(path, dtype, {"name": codec, "level": 1}, storage_options)
    write_shard(store, 0)
    sh = store.shards[1]
    writer = ShardWriter(store, sh)
    for i in range(sh.sample_begin, sh.sample_end - 1):
        writer.write_sample(i, *(as_input(x, i) for x in sample_bits(i, dtype)))
    writer.abort()
    write_shard(store, 2, failed={9: "verification failed"})
    return store, [0, 1, 2, 3, 8, 10]


def assert_sample_exact(sample: dict, i: int, dtype: str) -> None:
    names, ids, masks = plan()
    aux, final = sample_bits(i, dtype)
    assert sample["sample_id"] == names[i]
    assert torch.equal(sample["input_ids"], torch.from_numpy(ids[i].astype(np.int64)))
    assert torch.equal(sample["loss_mask"], torch.from_numpy(masks[i].astype(np.int64)))
    want = torch.bfloat16 if dtype == "bfloat16" else torch.float32
    assert sample["aux_hidden_states"].dtype == want == sample["final_hidden_states"].dtype
    assert sample["aux_hidden_states"].shape == (len(ids[i]), NUM_AUX * H)
    if dtype == "bfloat16":  # the stored bits, NaN payloads included
        got_aux = sample["aux_hidden_states"].view(torch.int16).numpy().view(np.uint16)
        got_final = sample["final_hidden_states"].view(torch.int16).numpy().view(np.uint16)
    else:
        got_aux, got_final = (
            sample[k].numpy() for k in ("aux_hidden_states", "final_hidden_states")
        )
    np.testing.assert_array_equal(got_aux, aux.reshape(len(aux), -1))
    np.testing.assert_array_equal(got_final, final)


FAILED = {6: "token ids differ from the plan"}  # a failed sample, named in its summary


def rows(i: int, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """Plausible hidden rows of sample i: finite, never zero."""
    rng = np.random.default_rng(100 + i)
    aux = rng.standard_normal((LENGTHS[i], NUM_AUX, H), np.float32) + 3
    final = rng.standard_normal((LENGTHS[i], H), np.float32) + 3
    if dtype == "bfloat16":
        return aux.astype(ml_dtypes.bfloat16), final.astype(ml_dtypes.bfloat16)
    return aux, final


def build_store(
    path: Path | str,
    dtype: str = "bfloat16",
    shards: tuple[int, ...] = (0, 1, 2),
    storage_options: dict | None = None,
) -> Path | str:
    rng = np.random.default_rng(0)
    ids = [rng.integers(0, 1000, n).astype(np.int32) for n in LENGTHS]
    masks = [np.ones(n, np.uint8) for n in LENGTHS]
    names = [f"s{i}" for i in range(len(LENGTHS))]
    rejected = [{"sample_id": "bad", "reason": "too long"}]
    store = create_store(
        path, manifest(dtype), names, ids, masks, rejected=rejected, storage_options=storage_options
    )
    for k in shards:
        shard = store.shards[k]
        writer = ShardWriter(store, shard)
        for i in range(shard.sample_begin, shard.sample_end):
            if i in FAILED:
                writer.mark_failed(i, FAILED[i])
            else:
                writer.write_sample(i, *rows(i, dtype))
        writer.commit({"worker": "test"})
    return path
