"""`verify --recompute N`: a random sample of stored rows against fresh captures of the same
prompts, on the patched server shared with the logprob check (cluster/verify/server.py).

Each chosen sample is prefilled alone and inside a batch of the others. Per sample and hidden
array the statistic is the largest per-row relative RMS difference (each row against its own
norm, so a massive-activation row neither sets it nor hides the others). The alone-vs-batched
spread is the noise; the stored rows must be within the bound of recompute_bound.py (a multiple
of the noise measured across all the samples checked) of the nearer recompute, and
`CROSS_MARGIN` times further from any other checked sample's recompute where their contexts
differ. Every finding names the sample, the array, both figures and the bound.

Design: docs/design/verify.md.
"""

from __future__ import annotations

import functools
import math
import uuid
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from actors.planned_sample import ImageUrls, PlannedSample, image_urls, planned_sample
from cluster.verify.model_check import ModelCheck
from cluster.verify.recompute_bound import NOISE_FLOOR, Bound, pooled_noise, relative
from hsx_store.fp8 import FP8_DTYPE, dequantize, scale_name

if TYPE_CHECKING:  # torch is imported where a recompute needs it: plain checks go without
    import torch

    from actors.capture_client import CaptureResponse
    from actors.sglang_server import SGLangServer

# Cross-sample: another sample's recompute must be this many times further than the own one
# (the margin tests/integration/test_capture_server.py asks of the HF reference).
CROSS_MARGIN = 10.0
# Prompts of one batched recompute request: SGLang prefills them together.
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


def describe_recompute(result: dict[str, Any]) -> str:
    """One recomputed sample (RecomputeCheck.judge's result): per hidden array, the stored
    rows' distance from the nearer fresh recompute, the noise (its own alone vs batched
    recompute, and pooled over the samples checked), the bound, and the distance from the
    recompute of the nearest other sample (largest per-row relative RMS each)."""
    parts = []
    for name, f in result["arrays"].items():
        other = (
            f" sample {f['nearest_other']}'s {relative(f['other_distance'])}"
            if "nearest_other" in f
            else ""
        )
        parts.append(
            f"{name.split('_')[0]} {relative(f['distance'])} (noise {relative(f['noise'])}, "
            f"all {relative(f['pooled_noise'])}, bound {relative(f['bound'])}){other}"
        )
    verdict = "ok" if result["ok"] else "FAIL"
    return f"sample {result['sample']} ({result['sample_id']}): {', '.join(parts)}: {verdict}"


Rows = dict[str, "torch.Tensor"]  # hidden array name -> [T, ..., H]


class RecomputeCheck(ModelCheck):
    """Recompute samples on the patched server, alone and batched, and judge the stored rows."""

    name = "recompute"
    cannot = "cannot recompute"
    listing = "recomputed samples"

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
        from actors.capture_client import generate_and_capture

        rid = self.rid(i, how)
        return self.read(generate_and_capture(server, rid, **self.planned(i).request()), i)

    def rid(self, i: int, how: str) -> str:
        return f"hsx-verify-{how}-s{i}-{uuid.uuid4().hex[:8]}"

    def read(self, response: CaptureResponse, i: int) -> Rows:
        """Sample i's rows from the dump `response` names, checked to be its; the dump is
        released."""
        from actors.capture_client import wait_for_dump
        from actors.dump_checks import check_tokens
        from patches.dump_files import read_dump, release_dump

        try:
            tensors, meta = read_dump(wait_for_dump(response.dump_path))
            if meta.get("rid") != response.rid:
                raise RuntimeError(f"the dump is not this request's (rid {meta.get('rid')!r})")
            check_tokens(tensors, self.planned(i))
            return {name: tensors[name].clone() for name in self.arrays}  # the dump is reused
        finally:
            release_dump(response.dump_path)

    def context(self, i: int) -> np.ndarray:
        """What sample i's rows depend on, row by row: its token ids, with an image's rows
        told apart by the image (the same question about two images differs there)."""
        sample = self.planned(i)
        ids = sample.input_ids.astype(np.int64)
        for image in sample.images:
            ids[image.start : image.start + image.length] = -1 - int(image.digest[:15], 16)
        return ids

    def planned(self, i: int) -> PlannedSample:
        """Sample i as the job sent it: its images resent with it."""
        return planned_sample(self.store, i, self._image_urls)

    @functools.cached_property
    def _image_urls(self) -> ImageUrls | None:
        return image_urls(self.store)  # each image read once per check

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
        batches = self.batched(server, list(alone))
        measured = {i: self.measure(i, alone[i], batched) for i, batched in batches}
        pooled = {
            name: pooled_noise(m[name]["noise"] for m in measured.values()) for name in self.arrays
        }
        for i in sorted(measured):  # they arrive as the batch completes
            results.append(self.judge(i, measured[i], pooled, len(measured)))
        self.cross_check(alone, {r["sample"]: r for r in results})
        for result in results:
            self.tell(describe_recompute(result))

    def batched(self, server: SGLangServer, samples: list[int]) -> Iterator[tuple[int, Rows]]:
        """The samples prefilled together: BATCH_REQUESTS at a time, each batch one request
        (a lone sample with a copy of itself as its company). As separate concurrent requests
        they were batched as they happened to arrive: on a busy machine, one by one, and the
        noise measured was then 0."""
        from actors.capture_client import CaptureError, generate_and_capture_batch

        requests = samples if len(samples) > 1 else samples * 2
        done: set[int] = set()  # a sample's first answer (or failure) is its

        def failed(i: int, exc: Exception) -> None:
            if i not in done:
                done.add(i)
                self.failed(i, "batched", exc)

        for start in range(0, len(requests), BATCH_REQUESTS):
            prompts, sample_of = {}, {}
            for i in requests[start : start + BATCH_REQUESTS]:
                try:
                    prompt = self.planned(i).request()
                except CaptureError as exc:  # its image: the store cannot give it
                    failed(i, exc)
                    continue
                rid = self.rid(i, "batched")
                prompts[rid], sample_of[rid] = prompt, i
            try:
                responses = generate_and_capture_batch(server, prompts) if prompts else {}
            except Exception as exc:  # the request as a whole: every prompt of it
                for i in sample_of.values():
                    failed(i, exc)
                continue
            for rid, response in responses.items():
                i = sample_of[rid]
                try:  # read (and so released) also where a copy of it came first
                    if isinstance(response, CaptureError):
                        raise response
                    rows = self.read(response, i)
                except Exception as exc:
                    failed(i, exc)
                    continue
                if i not in done:
                    done.add(i)
                    yield i, rows

    def measure(self, i: int, alone: Rows, batched: Rows) -> dict[str, dict[str, float]]:
        """Per hidden array, the noise (alone vs batched) and how far the stored rows are from the
        nearer recompute, at which token."""
        stored, figures = self.stored(i), {}
        for name in self.arrays:
            noise, _ = largest(row_distances(batched[name], alone[name]))
            distance, token = min(
                largest(row_distances(stored[name], fresh[name])) for fresh in (alone, batched)
            )  # NaN compares as neither smaller nor larger: a NaN row fails the bound either way
            figures[name] = {"distance": distance, "token": token, "noise": noise}
        return figures

    def judge(
        self, i: int, figures: dict[str, dict[str, float]], pooled: dict[str, float], samples: int
    ) -> dict[str, Any]:
        """The stored rows against the nearer recompute, within a multiple of the noise of every
        checked sample (recompute_bound.py)."""
        floor, ok = NOISE_FLOOR[self.store.manifest.dtype], True
        for name, f in figures.items():
            bound = Bound(f["noise"], pooled[name], samples, floor)
            f.update(pooled_noise=bound.pooled, bound=bound.value)
            if not bound.admits(f["distance"]):
                ok = False
                self.report.error(
                    "recompute",
                    f"sample {self.label(i)}: {name} differs from a fresh recompute by "
                    f"{relative(f['distance'])} (largest per-row relative RMS, token "
                    f"{int(f['token'])}); {bound.explain()}",
                )
        sample_id = str(self.store.group["sample_id"][i])
        return {"sample": i, "sample_id": sample_id, "arrays": figures, "ok": ok}

    def cross_check(self, alone: dict[int, Rows], results: dict[int, dict[str, Any]]) -> None:
        """Each sample's stored rows far closer to its own recompute than to any other's, on the
        rows where their prompts differ; the nearest other sample is named."""
        ids = {i: self.context(i) for i in alone}
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
