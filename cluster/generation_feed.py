"""Generate, then capture: the driver's side. Prompts go out in parts to the generation queue;
each part's responses, once durable, become the store's planned samples, in plan order.

    generate_into(builder, config, gen_queue, keep, on_shards, say, stop, stats)

1. The prompts are planned as rows are today (cluster/plan.py, `generate`): a row's prompt
   tokens, or a reject (no room for max_new_tokens, nothing to answer, ...).
2. Every `samples_per_shard // n` prompts make a part: its prompts are written to the store's
   location (hsx_store/generated.py) and the part goes to the generation queue. A part whose
   responses are already there (a resumed job) is not generated again.
3. In part order, each part's responses become samples: the prompt's tokens, then the response's
   tokens as the server returned them, then the turn end if the response stopped without it;
   the loss mask covers the response and the turn end. A prompt's images are expanded as a
   captured row's are (each image token its run of rows, loss 0), and an M-RoPE store's
   positions are HF's own for the whole sample. A response cut at max_new_tokens is kept
   (no turn end) or rejected (`generate.on_length`), an empty one is rejected, and a part the
   generation queue gave up has every sample rejected with its reason.

Design: docs/design/generation.md.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import ray

from cluster.config import JobConfig
from cluster.generation_stats import GenerationStats
from cluster.images import Vision, expand_images, text_positions
from cluster.job_store import describe_plan, no_usable_samples
from cluster.plan import PartEnd, PlanError, PlanStream, Reject, Sample
from hsx_store.builder import StoreBuilder
from hsx_store.format import Shard
from hsx_store.generated import GeneratedParts, closed_turn

POLL_S = (0.05, 0.5)  # waiting for a part's generation: first poll, longest backoff


def response_seed(job_seed: int, sample_id: str) -> int:
    """A response's sampling seed, from the job's and the sample id alone: a re-issued part
    samples with the same seeds (31 bits: any backend's generator takes it)."""
    digest = hashlib.sha256(f"{job_seed}\0{sample_id}".encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


def sample_ids(prompt_id: str, n: int) -> list[str]:
    """The samples of one prompt: its own id when n is 1, else `<id>#0` ... `<id>#<n-1>`."""
    return [prompt_id] if n == 1 else [f"{prompt_id}#{k}" for k in range(n)]


@dataclass
class _Part:
    index: int
    prompts: list[dict[str, Any]]
    kept: bool  # its responses were there before this run queued it


class ResponsePlanner:
    """Turns one part's responses into samples and rejects (step 3 of the module doc).
    `vision`: an image model's (its image token and positions; None: a text model's)."""

    def __init__(self, config: JobConfig, mrope: bool, vision: Vision | None = None) -> None:
        assert config.generate is not None
        self.generate = config.generate
        self.mrope = mrope  # the store keeps M-RoPE positions
        self.vision = vision
        # An image store's: a response holding it would be an image token without an image.
        self.image_token_id = None if vision is None else vision.image_token_id

    def samples(self, record: dict[str, Any]) -> list[Sample | Reject]:
        return [self.sample(s) for s in record["samples"]]

    def sample(self, s: dict[str, Any]) -> Sample | Reject:
        sample_id = s["sample_id"]
        if "error" in s:
            return Reject(sample_id, f"generation failed: {s['error']}")
        ids: list[int] = []
        mask: list[int] = []
        for k, (segment, turn) in enumerate(zip(s["segments"], s["turns"], strict=False)):
            written = closed_turn(turn["output_ids"], turn["finish_reason"], s["turn_end"])
            if not written or written == s["turn_end"]:
                return Reject(sample_id, f"empty response (turn {k})")
            if turn["finish_reason"] == "length" and self.generate.on_length == "reject":
                return Reject(
                    sample_id,
                    f"response cut at max_new_tokens {self.generate.max_new_tokens} (turn {k}; "
                    "generate.on_length: reject)",
                )
            if self.image_token_id is not None and self.image_token_id in written:
                return Reject(
                    sample_id,
                    f"the response holds the image token ({self.image_token_id}) (turn {k}), "
                    "without an image",
                )
            ids += [*segment, *written]
            mask += [0] * len(segment) + [1] * len(written)
        ids_, mask_ = np.asarray(ids, np.int32), np.asarray(mask, np.uint8)
        if s.get("images"):
            return self._with_images(sample_id, ids_, mask_, s["images"])
        positions = text_positions(len(ids)) if self.mrope else None
        return Sample(sample_id, ids_, mask_, position_ids=positions)

    def _with_images(
        self, sample_id: str, ids: np.ndarray, mask: np.ndarray, images: list[dict[str, Any]]
    ) -> Sample | Reject:
        """A sample whose prompt has images: each image token (the prompt's, one per image)
        expanded to its planned run, and, on an M-RoPE store, HF's positions of the whole.
        A conversation that ended early (a turn cut) holds the images of its segments only."""
        assert self.vision is not None and self.image_token_id is not None
        held = int(np.count_nonzero(ids == self.image_token_id))  # none in a written turn
        spans = [(im["digest"], im["length"], tuple(im["grid_thw"])) for im in images[:held]]
        row = expand_images(ids, mask, spans, self.image_token_id)
        positions = self.vision.positions(row.input_ids, row.images) if self.mrope else None
        if isinstance(positions, str):
            return Reject(sample_id, positions)
        return Sample(
            sample_id, row.input_ids, row.loss_mask, position_ids=positions, images=row.images
        )


def generate_into(
    builder: StoreBuilder,
    config: JobConfig,
    gen_queue: Any,
    keep: GeneratedParts,
    planners: int | None,
    on_shards: Callable[[list[Shard]], None],
    stats: GenerationStats,
    say: Any = print,
    stop: threading.Event | None = None,
) -> None:
    """plan_into's counterpart for a job with `generate:` (see the module doc)."""
    gen = config.generate
    assert gen is not None
    stream = PlanStream(
        config.data,
        config.model.path,
        config.model.trust_remote_code,
        planners=planners,
        generate=gen,
        images_to=(config.store.url, config.store.storage_options),
    )
    planner = ResponsePlanner(config, builder.m.position_ids == "mrope", stream.encoder.vision)
    turn_ends = {chat: stream.encoder.turn_end(chat) for chat in (True, False)}
    per_part = max(1, config.store.samples_per_shard // gen.n)
    rejected: list[dict[str, str]] = []
    waiting: deque[_Part] = deque()  # queued, in order, responses not yet planned
    current: list[dict[str, Any]] = []
    accepted = 0

    kept_before = set(keep.parts())  # one listing: a fresh store has none, a resumed one some

    def send(prompts: list[dict[str, Any]]) -> None:
        part = _Part(stats.parts, prompts, kept=stats.parts in kept_before)
        stats.parts += 1
        if part.kept:
            stats.reused_parts += 1
        else:
            keep.put_prompts(part.index, prompts)
            ray.get(gen_queue.add.remote([part.index]))
        waiting.append(part)

    def plan_ready(block: bool) -> None:
        """Plan the responses of the parts at the head of `waiting` that are durable; with
        `block`, wait for every one."""
        nonlocal accepted
        delay = POLL_S[0]
        while waiting:
            if stop is not None and stop.is_set():
                return
            part = waiting[0]
            # The queue says when a part is done (its responses are kept before it completes):
            # one cheap call per poll, the store read once.
            outcome = None if part.kept else ray.get(gen_queue.outcome.remote(part.index))
            if outcome is None and not part.kept:
                if not block:
                    return
                time.sleep(delay)
                delay = min(2 * delay, POLL_S[1])
                continue
            if outcome is not None and outcome[0] == "given up":
                failure = "; ".join(outcome[1]) or "given up"
                samples = [s for p in part.prompts for s in p["samples"]]
                record = {"samples": [{**s, "error": failure} for s in samples]}
            else:
                record = keep.responses(part.index)
                if record is None:
                    raise PlanError(f"generation part {part.index} completed but not kept")
                _check_answers(part, record)
            delay = POLL_S[0]
            waiting.popleft()
            stats.parts_done += 1
            _count(stats, record)
            for item in planner.samples(record):
                if isinstance(item, Reject):
                    rejected.append(item.to_json())
                    stats.rejected += 1
                elif shards := builder.add(
                    item.sample_id, item.input_ids, item.loss_mask, item.position_ids, item.images
                ):
                    on_shards(shards)
                accepted += isinstance(item, Sample)
            if shards := builder.flush():
                on_shards(shards)

    for item in stream:
        if stop is not None and stop.is_set():
            return
        if isinstance(item, Reject):
            rejected.append(item.to_json())
        elif isinstance(item, Sample):
            assert item.prompt is not None
            stats.prompts += 1
            prompt = item.prompt["prompt"]
            cuts = np.cumsum(item.prompt["segments"])[:-1]
            current.append(
                {
                    "prompt_id": item.sample_id,
                    "prompt": prompt,
                    "segments": [seg.tolist() for seg in np.split(item.input_ids, cuts)],
                    "turn_end": turn_ends[isinstance(prompt, list)],
                    **{k: item.prompt[k] for k in ("tools", "images") if k in item.prompt},
                    "samples": [
                        {"sample_id": sid, "seed": response_seed(gen.seed, sid)}
                        for sid in sample_ids(item.sample_id, gen.n)
                    ],
                }
            )
            if len(current) == per_part:
                send(current)
                current = []
        if isinstance(item, PartEnd):
            plan_ready(block=False)
    if current:
        send(current)
    ray.get(gen_queue.close.remote())
    plan_ready(block=True)
    if stop is not None and stop.is_set():
        return
    if not accepted:
        raise no_usable_samples(rejected, "rows or responses")
    if shards := builder.finish(rejected):
        on_shards(shards)
    say(
        describe_plan(builder.m, accepted, _tokens(builder), rejected, config.store.url)
        + f"\ngenerated {stats.responses} responses to {stats.prompts} prompts in "
        f"{stats.parts} parts ({stats.reused_parts} kept from an earlier run)"
    )


def _check_answers(part: _Part, record: dict[str, Any]) -> None:
    """A kept part's responses must answer this plan's prompts of that part: a resume whose
    plan changed otherwise (another release accepting other rows) would take one prompt's
    responses for another's."""
    kept = [s["sample_id"] for s in record["samples"]]
    planned = [s["sample_id"] for p in part.prompts for s in p["samples"]]
    if kept == planned:
        return
    pairs = enumerate(zip(kept, planned, strict=False))
    k = next((k for k, (a, b) in pairs if a != b), min(len(kept), len(planned)))
    raise PlanError(
        f"generation part {part.index} kept responses for other samples than this plan's (at "
        f"its sample {k}: kept {kept[k : k + 1]}, planned {planned[k : k + 1]}): the plan "
        "changed since they were generated; write to a new store"
    )


def _tokens(builder: StoreBuilder) -> int:
    return int(builder.store.sample_length.sum())


def _count(stats: GenerationStats, record: dict[str, Any]) -> None:
    for s in record["samples"]:
        for turn in s.get("turns", ()):
            stats.responses += 1
            stats.generated_tokens += len(turn["output_ids"])
            stats.finish_reasons[turn["finish_reason"]] += 1
    if "started_at" in record:  # a part given up has no responses, and no times
        start = float(record["started_at"])
        stats.generate_spans.append((start, start + float(record["seconds"])))
