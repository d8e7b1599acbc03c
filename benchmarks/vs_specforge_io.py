"""Our hidden-state I/O against SpecForge 0.2.0's offline path, on the same rows and disk.

Write: SpecForge's `HiddenStatesGenerator` (reproduced from its source: a NaN scan and
`torch.save` per sample on a thread pool) vs `check_dump` + `ShardWriter`, commits included.
Cold read (page cache dropped per file with posix_fadvise): its `FeatureDataLoader` (4 threads)
vs `HiddenStatesIterable`, and vs `dd` of our chunk files. The collator (padding to a batch) is
left out on both sides. Bytes per token against the payload, measured and projected at 64
samples per shard. Kimi-shaped rows, 32 samples (2 GB) by default; rounds alternate
(benchmarks/rounds.py). RESULT value = min(write / 1.5, cold read / 1.1, vs dd / 0.85).

    make bench BENCH=vs_specforge_io
    .venv/bin/python -m benchmarks.vs_specforge_io --samples 32 --rounds 5

Method, figures and why 32 samples: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import tempfile
import time
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

from actors.calibration_result import Calibration
from actors.config import StoreConfig
from actors.dump_checks import check_dump
from actors.shard_writer import ShardWriter
from benchmarks.reader_vs_raw_read import stand_in_manifest
from benchmarks.rounds import Rounds, alternate
from hsx_store.builder import create_store
from hsx_store.format import HIDDEN_ARRAYS, Store, layout
from hsx_store.reader import HiddenStatesIterable

try:  # the peer's reader, imported from its release (requirements/bench.txt)
    from specforge.algorithms.eagle3.data import normalize_offline_sample
    from specforge.runtime.data_plane.feature_dataloader import FeatureDataLoader
    from specforge.runtime.data_plane.feature_store import LocalFeatureStore
    from specforge.runtime.data_plane.offline_reader import OfflineManifestReader
except ImportError as exc:
    SPECFORGE_MISSING: str | None = f"{exc}: pip install --no-deps -r requirements/bench.txt"
else:
    SPECFORGE_MISSING = None

WRITE_TARGET, PEER_READ_TARGET, DD_TARGET = 1.5, 1.1, 0.85
PEER_FILE_GROUP = 2000  # HiddenStatesGenerator.file_group_size
PEER_IO_QUEUE = 50  # HiddenStatesGenerator.io_queue_size
PEER_LOADER_WORKERS = 4  # eagle3's default_dataloader_num_workers
JOB_SAMPLES_PER_SHARD = StoreConfig.model_fields["samples_per_shard"].default


class Sample:
    """One captured sample as both writers get it: CPU tensors, aux [P, num_aux, H]."""

    def __init__(self, index: int, aux: torch.Tensor, final: torch.Tensor) -> None:
        p = aux.shape[0]
        self.index, self.aux, self.final = index, aux, final
        self.ids = torch.arange(p, dtype=torch.int64) % 32000
        self.mask = torch.ones(p, dtype=torch.int64)

    @property
    def nbytes(self) -> int:
        return self.aux.nbytes + self.final.nbytes


def make_samples(count: int, lo: int, hi: int, num_aux: int, hidden: int) -> list[Sample]:
    """bf16 rows of random lengths. Nothing is compressed on either side, so the values only
    need to be finite: samples are copies of one random pool at random offsets (generating
    4 GB of fresh gaussians would take longer than the benchmark)."""
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(lo, hi + 1, (count,), generator=g).tolist()
    pool = (torch.randn(2 * hi, num_aux + 1, hidden, generator=g) * 4).to(torch.bfloat16)
    samples = []
    for i, p in enumerate(lengths):
        at = int(torch.randint(0, hi, (1,), generator=g))
        rows = pool[at : at + p]
        samples.append(Sample(i, rows[:, :num_aux].contiguous(), rows[:, num_aux].contiguous()))
    return samples


# -- the peer: SpecForge's offline dump, reproduced --------------------------------------------


def peer_save_sync(record: dict[str, torch.Tensor], output_file: str) -> None:
    """HiddenStatesGenerator._save_tensor_sync (uncompressed): skip a record with a NaN."""
    for tensor in record.values():
        if (torch.is_floating_point(tensor) or torch.is_complex(tensor)) and bool(
            torch.isnan(tensor).any()
        ):
            return
    torch.save(record, output_file)


def peer_file(root: Path, i: int) -> Path:
    g = (i // PEER_FILE_GROUP) * PEER_FILE_GROUP
    return root / f"rows_{g}-{g + PEER_FILE_GROUP}" / f"data_{i}.ckpt"


def peer_write(samples: list[Sample], root: Path, threads: int) -> None:
    """HiddenStatesGenerator.generate's I/O half: records to a thread pool, back-pressured."""
    for i in {s.index // PEER_FILE_GROUP for s in samples}:  # _prepare_output_dirs
        peer_file(root, i * PEER_FILE_GROUP).parent.mkdir(parents=True, exist_ok=True)
    pending: list[Future[None]] = []
    with ThreadPoolExecutor(max_workers=threads) as pool:
        for s in samples:
            p = s.aux.shape[0]
            record = {  # OfflineCaptureLayout(eagle3).materialize
                "input_ids": s.ids,
                "loss_mask": s.mask,
                "aux_hidden_state": s.aux.view(1, p, -1),
                "hidden_state": s.final.unsqueeze(0),
            }
            if len(pending) >= PEER_IO_QUEUE:  # _save_tensor_async's back-pressure
                pending = [f for f in pending if not f.done()]
                if len(pending) >= PEER_IO_QUEUE:
                    pending.pop(0).result()
            pending.append(pool.submit(peer_save_sync, record, str(peer_file(root, s.index))))
        for f in pending:  # _wait_all_saves
            f.result()


def peer_read(root: Path, max_len: int) -> int:
    """SpecForge's offline eagle3 loading, imported; returns the hidden-state bytes seen."""
    refs = OfflineManifestReader(str(root), max_len=max_len).read()
    loader = FeatureDataLoader(
        LocalFeatureStore("bench"),
        refs=refs,
        batch_size=1,
        collate_fn=lambda features: features[0],  # no padding copy (see the docstring)
        per_sample_transform=partial(normalize_offline_sample, max_len=max_len),
        num_workers=PEER_LOADER_WORKERS,
    )
    seen = 0
    for batch in loader:
        seen += sum(batch.tensors[k].nbytes for k in ("hidden_state", "target"))
    return seen


# -- ours ---------------------------------------------------------------------------------------


def new_store(root: Path, samples: list[Sample], per_shard: int, max_len: int) -> Store:
    """The driver's part (untimed): a created store planned for these samples."""
    num_aux, hidden = samples[0].aux.shape[1:]
    manifest = stand_in_manifest(root, num_aux, hidden, max_len, per_shard)
    ids = [s.ids.numpy().astype(np.int32) for s in samples]
    masks = [s.mask.numpy().astype(np.uint8) for s in samples]
    names = [f"s{s.index}" for s in samples]
    return create_store(root / "store.zarr", manifest, names, ids, masks)


def ours_write(samples: list[Sample], store: Store) -> None:
    """A worker's write path: every dump verified against its plan, then its rows stored."""
    m, calibration = store.manifest, Calibration(offset=0, probe_tokens=0, seconds=0.0)
    for shard in store.shards:
        writer = ShardWriter(store, shard)
        for i in range(shard.sample_begin, shard.sample_end):
            s = samples[i]
            tensors = {
                "input_ids": s.ids,
                "aux_hidden_states": s.aux,
                "final_hidden_states": s.final,
            }
            meta = {"rid": f"r{i}", "index": i + 1, "layer_ids": m.layer_ids}
            check_dump(
                tensors,
                meta,
                rid=f"r{i}",
                input_ids=s.ids.numpy(),
                cached_tokens=0,
                manifest=m,
                calibration=calibration,
            )
            writer.write_sample(i, s.aux, s.final)
        writer.commit({})


def ours_read(url: Path) -> int:
    seen = 0
    for sample in HiddenStatesIterable(str(url)):
        seen += sample["aux_hidden_states"].nbytes + sample["final_hidden_states"].nbytes
    return seen


# -- disk helpers -------------------------------------------------------------------------------


def files_under(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file())


def chunk_files(url: Path) -> list[Path]:
    return [p for name in HIDDEN_ARRAYS for p in files_under(url / name / "c")]


def drop_pages(paths: list[Path]) -> None:
    """Evict the files' pages (clean after a sync) from the page cache, these files only."""
    os.sync()
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def resident_bytes(paths: list[Path]) -> int | None:
    """Bytes of the files in the page cache, by util-linux `fincore`; None without it."""
    if shutil.which("fincore") is None:
        return None
    out = subprocess.run(
        ["fincore", "--bytes", "--noheadings", "--raw", "--output", "RES", *map(str, paths)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return sum(int(v) for v in out.split())


def dd_seconds(paths: list[Path]) -> float:
    """`dd bs=16M` of each file in turn, one shell for all (no per-file Python)."""
    script = 'for f in "$@"; do dd if="$f" of=/dev/null bs=16M status=none; done'
    start = time.perf_counter()
    subprocess.run(["bash", "-c", script, "dd", *map(str, paths)], check=True)
    return time.perf_counter() - start


def padding_rows(lengths: Any, samples_per_shard: int, chunk_tokens: int) -> int:
    """Rows stored beyond the samples' own: each shard's last chunk is padded to its end."""
    _, shards, total = layout(lengths, samples_per_shard, chunk_tokens)
    return total - sum(sh.token_end - sh.token_begin for sh in shards)


def timed(fn: Any, *args: Any) -> tuple[float, Any]:
    start = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - start, out


def show(title: str, rounds: Rounds, baseline: str, measured: str, target: float) -> None:
    print(f"\n{title} (target {target}x)")
    rounds.show("GB/s", baseline=baseline, measured=measured)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--min-len", type=int, default=256)
    parser.add_argument("--max-len", type=int, default=2048)
    parser.add_argument("--num-aux", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--samples-per-shard", type=int, default=JOB_SAMPLES_PER_SHARD)
    parser.add_argument("--num-io-threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    if SPECFORGE_MISSING is not None:
        print(f"SKIP: SpecForge's reader cannot be imported ({SPECFORGE_MISSING})")
        return

    samples = make_samples(args.samples, args.min_len, args.max_len, args.num_aux, args.hidden)
    payload = sum(s.nbytes for s in samples)
    tokens = sum(s.aux.shape[0] for s in samples)
    print(
        f"{len(samples)} samples, {tokens} tokens, {payload / 1e9:.2f} GB of bf16 hidden states "
        f"({args.num_aux} aux + 1 final x H={args.hidden}); peer writes on "
        f"{args.num_io_threads} threads, reads on {PEER_LOADER_WORKERS}"
    )
    with tempfile.TemporaryDirectory(dir=os.getcwd(), prefix=".bench-vs-specforge-") as tmp:
        root = Path(tmp)
        latest: dict[str, Path] = {}

        def fresh(side: str) -> Path:
            """A new output dir for `side`; its previous one removed and all dirty pages
            flushed first, so neither side pays for the other's writeback."""
            if side in latest:
                shutil.rmtree(latest[side])
            n = len(list(root.glob(f"{side}-*")))
            latest[side] = root / f"{side}-{n}"
            latest[side].mkdir()
            os.sync()
            return latest[side]

        def peer_write_rate() -> float:
            out = fresh("peer")
            seconds, _ = timed(peer_write, samples, out, args.num_io_threads)
            return payload / seconds / 1e9

        def ours_write_rate() -> float:
            store = new_store(fresh("ours"), samples, args.samples_per_shard, args.max_len)
            os.sync()  # the store's creation (the driver's) is not on the writer's clock
            seconds, _ = timed(ours_write, samples, store)
            return payload / seconds / 1e9

        # Before every call, memory for what it takes (page cache, the peer's clones) faulted in:
        # benchmarks/rounds.py says why.
        warm = payload * 3 // 2
        write = alternate(peer_write_rate, ours_write_rate, args.rounds, fault_in_bytes=warm)
        peer_dir, url = latest["peer"], latest["ours"] / "store.zarr"
        peer_files, our_files, chunks = files_under(peer_dir), files_under(url), chunk_files(url)
        chunk_bytes = sum(p.stat().st_size for p in chunks)

        def drop_all() -> None:
            drop_pages(peer_files + our_files)

        def peer_read_rate() -> float:
            seconds, seen = timed(peer_read, peer_dir, args.max_len)
            assert seen == payload, (seen, payload)
            return payload / seconds / 1e9

        def ours_read_rate() -> float:
            seconds, seen = timed(ours_read, url)
            assert seen == payload, (seen, payload)
            return payload / seconds / 1e9

        def dd_rate() -> float:  # the disk's rate: every byte of the chunk files, padding too
            return chunk_bytes / dd_seconds(chunks) / 1e9

        read = alternate(peer_read_rate, ours_read_rate, args.rounds, drop_all, warm)
        disk = alternate(dd_rate, ours_read_rate, args.rounds, drop_all, warm)
        # Evidence that the drop works: what the last read left resident, and after a drop.
        before = resident_bytes(peer_files + our_files)
        drop_all()
        after = resident_bytes(peer_files + our_files)

        on_disk = sum(p.stat().st_size for p in our_files)
        peer_on_disk = sum(p.stat().st_size for p in peer_files)
        store = Store.open(url)
        c = store.manifest.chunk_tokens
        padded_tokens = sum(-(-sh.token_end // c) * c - sh.token_end for sh in store.shards)
        assert padded_tokens == padding_rows(store.sample_length, args.samples_per_shard, c)

    if before is not None:
        print(
            f"page cache of both sides' files (fincore): {before / 1e9:.2f} GB resident after "
            f"the last read, {after / 1e9:.2f} GB after dropping their pages"
        )
    show("WRITE", write, "specforge torch.save", "ours verify+ShardWriter", WRITE_TARGET)
    show("COLD READ vs peer", read, "specforge loader", "ours HiddenStatesIterable", 1.1)
    show("COLD READ vs disk", disk, "dd bs=16M", "ours HiddenStatesIterable", DD_TARGET)
    row = (args.num_aux + 1) * args.hidden * 2
    print(
        f"\nBYTES PER TOKEN: ours {on_disk / tokens:.0f} B on disk vs {row} B payload: "
        f"{on_disk / tokens / row - 1:+.2%} (chunk padding at shard ends: {padded_tokens} rows "
        f"of {tokens}, chunk_tokens {c}, "
        f"{args.samples_per_shard} samples/shard); specforge "
        f"{peer_on_disk / tokens:.0f} B ({peer_on_disk / tokens / row - 1:+.2%})"
    )
    lengths = torch.randint(args.min_len, args.max_len + 1, (10_000,), generator=torch.Generator())
    projected = padding_rows(lengths.numpy(), args.samples_per_shard, c) / int(lengths.sum())
    print(
        f"  projected over 10,000 samples at {args.samples_per_shard} samples/shard: "
        f"{projected:+.2%} (target within 1%)"
    )
    ratios = {
        "write": write.median / WRITE_TARGET,
        "cold_read": read.median / PEER_READ_TARGET,
        "dd": disk.median / DD_TARGET,
    }
    print(
        f"ratio / target: write {write.median:.3f}/{WRITE_TARGET} = {ratios['write']:.3f}, "
        f"cold read {read.median:.3f}/{PEER_READ_TARGET} = {ratios['cold_read']:.3f}, "
        f"vs dd {disk.median:.3f}/{DD_TARGET} = {ratios['dd']:.3f}"
    )
    print(f"RESULT name=vs_specforge_io value={min(ratios.values()):.3f} target=1.0 unit=ratio")


if __name__ == "__main__":
    main()
