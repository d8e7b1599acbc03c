"""Generate, then capture: the worker's side. One part's prompts answered by the worker's own
server, many requests in flight (SGLang batches their decode), each response with its seed.

    part = PartGeneration(pool, server, prompts, config.generate, attempts, timeout, images)
    record = part.record()                   # once every sample is done

Requests carry token ids and a rid outside the capture prefix: generation dumps nothing. A
prompt with images carries one image token per image and, as a capture request does
(actors/planned_sample.py), the images so far as data URLs read from the store. The record
holds, per sample, the tokens the server returned (`output_ids`), never a retokenized text; its
text is for reading only. Design: docs/design/generation.md.
"""

from __future__ import annotations

import time
import uuid
from concurrent.futures import Executor, Future
from dataclasses import dataclass
from typing import Any

from actors.config import GenerateConfig
from actors.planned_sample import ImageUrls
from actors.sglang_server import SGLangServer
from hsx_store.generated import closed_turn

GENERATE_RID_PREFIX = "gen-"  # never the capture plugin's prefix: nothing is dumped


class GenerationError(RuntimeError):
    """A response the server would not give (after the sample's attempts)."""


@dataclass(frozen=True)
class PromptImages:
    """An image store's: its image token, and the reader of its images as data URLs."""

    image_token_id: int
    urls: ImageUrls

    def data(self, digests: list[str]) -> list[str]:
        """The images' data URLs; one the store cannot give is the sample's GenerationError."""
        try:
            return [self.urls(digest) for digest in digests]
        except Exception as exc:  # a missing or damaged blob, a failed GET
            raise GenerationError(f"cannot read its image: {type(exc).__name__}: {exc}") from exc


def generate_one(
    server: SGLangServer,
    prompt_ids: list[int],
    sampling: dict[str, Any],
    seed: int,
    timeout: float,
    image_data: list[str] | None = None,
) -> dict[str, Any]:
    """One response: its token ids as the server returned them, finish reason, text.
    `sampling` holds SGLang's sampling parameters but the seed; `image_data`: the prompt's
    images (data URLs), one per image token of `prompt_ids`."""
    rid = f"{GENERATE_RID_PREFIX}{uuid.uuid4().hex}"
    payload: dict[str, Any] = {
        "rid": rid,
        "input_ids": prompt_ids,
        "sampling_params": {**sampling, "sampling_seed": seed},
    }
    if image_data:
        payload["image_data"] = image_data
    response = server.session.post(server.url + "/generate", json=payload, timeout=timeout)
    if response.status_code != 200:
        raise GenerationError(f"HTTP {response.status_code}: {response.text[:500]}")
    body = response.json()
    finish = body["meta_info"].get("finish_reason") or {}
    kind = finish.get("type")
    if kind not in ("stop", "length"):
        raise GenerationError(f"finished with {finish!r}")
    return {"output_ids": list(body["output_ids"]), "finish_reason": kind, "text": body["text"]}


def write_turns(
    server: SGLangServer,
    prompt: dict[str, Any],
    sampling: dict[str, Any],
    seed: int,
    timeout: float,
    images: PromptImages | None = None,
) -> list[dict[str, Any]]:
    """One sample's turns, in order: each turn's prompt is everything before it, the earlier
    turns as they were written (hsx_store/generated.py `closed_turn`), with the images its
    segments hold so far. A turn cut at max_new_tokens, or one holding the image token (its
    sample is rejected: an image token without an image), ends the conversation."""
    segments, turn_end = prompt["segments"], prompt["turn_end"]
    params = {**sampling, "stop_token_ids": turn_end[:1]}  # the server stops where turns end
    digests = [image["digest"] for image in prompt.get("images", ())]
    if digests and images is None:  # a store without images planned none: never sent bare
        raise GenerationError("its prompt has images, but the worker reads none")
    token = images.image_token_id if images else None
    ids: list[int] = []
    shown = 0  # the prompt's images in the segments so far
    turns: list[dict[str, Any]] = []
    for segment in segments:
        ids += segment
        shown += segment.count(token) if digests else 0
        data = images.data(digests[:shown]) if images and shown else None
        turn = generate_one(server, ids, params, seed, timeout, data)
        turns.append(turn)
        if turn["finish_reason"] == "length" or (token is not None and token in turn["output_ids"]):
            break
        ids += closed_turn(turn["output_ids"], turn["finish_reason"], turn_end)
    return turns


def write_sample(
    server: SGLangServer,
    prompt: dict[str, Any],
    sample: dict[str, Any],
    sampling: dict[str, Any],
    attempts: int,
    timeout: float,
    images: PromptImages | None = None,
) -> dict[str, Any]:
    """One sample's record entry: its turns, or the error the server gave `attempts` times.
    A server that is gone raises (requests' errors): not the sample's fault."""
    entry = {
        "sample_id": sample["sample_id"],
        "seed": sample["seed"],
        "prompt": prompt["prompt"],
        "segments": prompt["segments"],
        "turn_end": prompt["turn_end"],
        **{k: prompt[k] for k in ("tools", "images") if k in prompt},
    }
    error = None
    for _ in range(attempts):
        try:
            turns = write_turns(server, prompt, sampling, sample["seed"], timeout, images)
            return {**entry, "turns": turns}
        except GenerationError as exc:
            error = exc
    return {**entry, "error": f"after {attempts} attempts: {error}"}


class PartGeneration:
    """One part's samples, submitted to the worker's pool of request threads (its K in flight).
    Parts share the pool: the next part's requests start as this one's last ones finish, so
    the server's batch never drains between parts."""

    def __init__(
        self,
        pool: Executor,
        server: SGLangServer,
        prompts: list[dict[str, Any]],
        config: GenerateConfig,
        attempts: int,
        timeout: float,
        images: PromptImages | None = None,
    ) -> None:
        self.sampling, self.seed = config.sampling_params(), config.seed
        self.started_at, self._started = time.time(), time.monotonic()
        self.futures: list[Future[dict[str, Any]]] = [
            pool.submit(write_sample, server, p, s, self.sampling, attempts, timeout, images)
            for p in prompts
            for s in p["samples"]
        ]

    @property
    def outstanding(self) -> int:
        return sum(not f.done() for f in self.futures)

    def record(self) -> dict[str, Any]:
        """The part's responses, once every sample is done; raises a sample's server error."""
        samples = [f.result() for f in self.futures]
        return {
            "samples": samples,
            "sampling": self.sampling,
            "seed": self.seed,
            "started_at": round(self.started_at, 3),  # wall clock: comparable across nodes
            "seconds": round(time.monotonic() - self._started, 3),
        }

    def cancel(self) -> None:
        for f in self.futures:
            f.cancel()
