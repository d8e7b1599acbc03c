"""`verify --recompute N`: a random sample of stored rows against fresh captures of the same
prompts, on the patched server shared with the logprob check (cluster/verify/server.py).

Each chosen sample is prefilled alone and inside a batch of the others. Per sample and hidden
array the statistic is the largest per-row relative RMS difference. The alone-vs-batched spread
is the noise; the stored rows must be within `NOISE_MULTIPLE` x max(noise, `NOISE_FLOOR`) of the
nearer recompute, and `CROSS_MARGIN` times further from any other checked sample's recompute
where their contexts differ. Every finding names the sample, the array, both figures and the
bound. The bounds' measurements are in the comments next to the constants.

Design: docs/design/verify.md.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor, as_completed
from typing import TYPE_CHECKING, Any

import numpy as np

from cluster.verify.model_check import ModelCheck
from hsx_store.fp8 import FP8_DTYPE, dequantize, scale_name
from hsx_store.integrity import describe_recompute, relative

if TYPE_CHECKING:  # torch is imported where a recompute needs it: plain checks go without
    import torch

    from actors.sglang_server import SGLangServer

# Bounds of the recompute check, from figures measured on llama-tiny in bf16 on CPU (the bf16
# job of tests/integration/test_verify_model_checks.py, three runs: 8 prompts of 3..48 tokens,
# `--chunked-prefill-size 16`). Without chunked prefill, alone and batched recomputes were
# bit-identical (prompts of 3..141 tokens, llama-tiny and llama-bench); with it a batch moves
# the chunk boundaries: alone vs batched 0.33%..1.20% where they moved, 0 where not (which
# samples, varied run to run). The job's rows against the nearer recompute: 0..1.16%, up to
# 2.9 x the noise where it was small, 0.79%..1.16% where the recomputes agreed bit for bit
# (the job batched those otherwise), so at
# most 1.16 x max(noise, 1%). Wrong rows: 50% (scaled by 1.5), 100%..153% (shifted by a token,
# another sample's); another sample's recompute >= 118% from correct rows.
# So a multiple of 4 (3.4 x the worst ratio seen) and, in bf16, a floor of 1% (~2.5 roundings
# of the 8-bit significand): the bound is >= 4%, 12 x below the nearest wrong rows. float32
# (deepseek-v3-tiny, the float32 job): alone vs batched 0..6.1e-7, the job's rows 0..1.6e-7
# from the nearer recompute; its floor of 1e-5 is 16 x that noise and 10 x what float32
# serving differs from HF float32 by (<= 1.0e-6 relative RMS, tests/helpers/hf_reference.py).
NOISE_MULTIPLE = 4.0
# fp8_e4m3 stores hold bf16 rows rounded to e4m3: their worst row is 3.1% from the bf16 one
# (benchmarks/fp8_fidelity.py on captured rows), on top of bf16's 1.16%: a floor of 2% (a bound
# of 8%, still 6 x below the nearest wrong rows' 50%).
NOISE_FLOOR = {"bfloat16": 1e-2, "float32": 1e-5, FP8_DTYPE: 2e-2}
# Cross-sample: another sample's recompute must be this many times further than the own one
# (the margin tests/integration/test_capture_server.py asks of the HF reference).
CROSS_MARGIN = 10.0
# Concurrent requests of the batched recompute: enough for SGLang to batch several.
BATCH_REQUESTS = 16


def row_distances(actual: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """Per token, the largest relative RMS difference |a - r| / |r| over its [H] rows."""
    import torch

    tokens, h = reference.shape[0], reference.shape[-1]
    a = actual.float().reshape(tokens, -1, h)
    r = reference.float().reshape(tokens, -1, h)
    norm = r.norm(dim=-1).clamp_min(torch.finfo(torch.float32).tiny)
    return ((a - r).norm(dim=-1) / norm).amax(dim=-1)


def largest(distances: torch.Tensor) -> tuple[float, int]:
    """(largest distance, its token); NaN when any is NaN."""
    if bool(distances.isnan().any()):
        return float("nan"), int(distances.isnan().nonzero()[0])
    token = int(distances.argmax())
    return float(distances[token]), token


def first_difference(a: np.ndarray, b: np.ndarray) -> int | None:
    """The first token where two prompts differ within the shorter; None if one is a prefix."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else None


Rows = dict[str, "torch.Tensor"]  # hidden array name -> [T, ..., H]


class RecomputeCheck(ModelCheck):
    """Recompute samples on the patched server, alone and batched, and judge the stored rows."""

    name = "recompute"
    cannot = "cannot recompute"

    @property
    def arrays(self) -> tuple[str, ...]:
        return self.store.manifest.hidden_arrays  # the dump has each too

    def stored(self, i: int) -> Rows:
        import torch

        rows, out, g = self.store.sample_rows(i), {}, self.store.group
        for name in self.arrays:
            data = np.asarray(g[name][rows])
            if self.store.manifest.dtype == FP8_DTYPE:
                out[name] = dequantize(data, np.asarray(g[scale_name(name)][rows]))
            elif data.dtype == np.uint16:  # bf16 bits
                out[name] = torch.from_numpy(data.view(np.int16).copy()).view(torch.bfloat16)
            else:
                out[name] = torch.from_numpy(np.ascontiguousarray(data))
        return out

    def capture(self, server: SGLangServer, i: int, how: str) -> Rows:
        from actors.capture_client import generate_and_capture, wait_for_dump
        from patches.dump_files import read_dump, release_dump

        ids = self.input_ids(i)
        rid = f"hsx-verify-{how}-s{i}-{uuid.uuid4().hex[:8]}"
        response = generate_and_capture(server, rid, input_ids=ids.tolist())
        try:
            tensors, meta = read_dump(wait_for_dump(response.dump_path))
            if meta.get("rid") != rid or not np.array_equal(tensors["input_ids"].numpy(), ids):
                raise RuntimeError(f"the dump is not this request's (rid {meta.get('rid')!r})")
            return {name: tensors[name].clone() for name in self.arrays}  # the dump is reused
        finally:
            release_dump(response.dump_path)

    def failed(self, i: int, how: str, exc: Exception) -> None:
        self.report.error(
            "recompute",
            f"sample {self.label(i)}: {how} recompute failed: {type(exc).__name__}: {exc}",
        )

    def run_on(self, samples: list[int]) -> None:
        assert self.server is not None
        results: list[dict[str, Any]] = []
        self.report.checked["recomputed"] = results
        server, _ = self.server.get(self.store)
        alone: dict[int, Rows] = {}
        for i in samples:  # one request at a time: each prefilled alone
            try:
                alone[i] = self.capture(server, i, "alone")
            except Exception as exc:
                self.failed(i, "alone", exc)
                if not server.alive():
                    self.report.error("recompute", "the SGLang server died; stopping")
                    return
        if not alone:
            return
        for i, batched in self.batched(server, list(alone)):
            results.append(self.judge(i, alone[i], batched))
        results.sort(key=lambda r: r["sample"])  # they arrive as the batch completes
        self.cross_check(alone, {r["sample"]: r for r in results})
        for result in results:
            self.say(f"recompute {describe_recompute(result)}")

    def batched(self, server: SGLangServer, samples: list[int]) -> Iterator[tuple[int, Rows]]:
        """Every sample sent at once (a lone one with a copy of itself as its company)."""
        requests = samples if len(samples) > 1 else samples * 2
        seen: set[int] = set()
        with ThreadPoolExecutor(min(len(requests), BATCH_REQUESTS)) as pool:
            futures = {pool.submit(self.capture, server, i, "batched"): i for i in requests}
            for future in as_completed(futures):
                i = futures[future]
                if i in seen:
                    continue
                seen.add(i)
                try:
                    yield i, future.result()
                except Exception as exc:
                    self.failed(i, "batched", exc)

    def judge(self, i: int, alone: Rows, batched: Rows) -> dict[str, Any]:
        """The stored rows against the nearer recompute, within a multiple of their spread."""
        floor = NOISE_FLOOR[self.store.manifest.dtype]
        figures: dict[str, dict[str, float]] = {}
        stored, ok = self.stored(i), True
        for name in self.arrays:
            noise, _ = largest(row_distances(batched[name], alone[name]))
            distance, token = min(
                largest(row_distances(stored[name], fresh[name])) for fresh in (alone, batched)
            )  # NaN compares as neither smaller nor larger: a NaN row fails below either way
            bound = NOISE_MULTIPLE * max(noise, floor)
            figures[name] = {"distance": distance, "token": token, "noise": noise, "bound": bound}
            if not distance <= bound:  # NaN fails too
                ok = False
                self.report.error(
                    "recompute",
                    f"sample {self.label(i)}: {name} differs from a fresh recompute by "
                    f"{relative(distance)} (largest per-row relative RMS, token {token}); alone "
                    f"vs batched recompute {relative(noise)}; bound {relative(bound)} = "
                    f"{NOISE_MULTIPLE:g} x max(that, floor {floor:.0e})",
                )
        sample_id = str(self.store.group["sample_id"][i])
        return {"sample": i, "sample_id": sample_id, "arrays": figures, "ok": ok}

    def cross_check(self, alone: dict[int, Rows], results: dict[int, dict[str, Any]]) -> None:
        """Each sample's stored rows far closer to its own recompute than to any other's, on the
        rows where their prompts differ; the nearest other sample is named."""
        ids = {i: self.input_ids(i) for i in alone}
        for i, result in results.items():
            stored = self.stored(i)
            for name in self.arrays:
                pairs = []  # (other's distance / own, other, own distance, other's, rows)
                for j in alone:
                    start = None if j == i else first_difference(ids[i], ids[j])
                    if start is None:  # one prompt a prefix of the other: the same rows
                        continue
                    rows = slice(start, min(len(ids[i]), len(ids[j])))
                    s = stored[name][rows]
                    near, _ = largest(row_distances(s, alone[i][name][rows]))
                    far, _ = largest(row_distances(s, alone[j][name][rows]))
                    ratio = far / near if near > 0 else float("inf") if far > 0 else 0.0
                    pairs.append((-math.inf if math.isnan(ratio) else ratio, j, near, far, rows))
                if not pairs:
                    continue
                ratio, j, near, far, rows = min(pairs, key=lambda p: p[0])
                result["arrays"][name].update(nearest_other=j, other_distance=far)
                if not ratio > CROSS_MARGIN:
                    result["ok"] = False
                    self.report.error(
                        "recompute",
                        f"sample {self.label(i)}: {name} tokens {rows.start}..{rows.stop - 1} are "
                        f"{relative(far)} from sample {self.label(j)}'s recompute, not "
                        f"{CROSS_MARGIN:g} x further than from its own ({relative(near)})",
                    )
