"""Generate, then capture: the worker's side. One part's prompts answered by the worker's own
server, many requests in flight (SGLang batches their decode), each response with its seed.

    part = PartGeneration(pool, server, prompts, config.generate, attempts, timeout)
    record = part.record()                   # once every sample is done

Requests carry token ids and a rid outside the capture prefix: generation dumps nothing. The
record holds, per sample, the tokens the server returned (`output_ids`), never a retokenized
text; its text is for reading only. Design: docs/design/generation.md.
"""

from __future__ import annotations

import time
import uuid
from concurrent.futures import Executor, Future
from typing import Any

from actors.config import GenerateConfig
from actors.sglang_server import SGLangServer
from hsx_store.generated import closed_turn

GENERATE_RID_PREFIX = "gen-"  # never the capture plugin's prefix: nothing is dumped


class GenerationError(RuntimeError):
    """A response the server would not give (after the sample's attempts)."""


def generate_one(
    server: SGLangServer,
    prompt_ids: list[int],
    sampling: dict[str, Any],
    seed: int,
    timeout: float,
) -> dict[str, Any]:
    """One response: its token ids as the server returned them, finish reason, text.
    `sampling` holds SGLang's sampling parameters but the seed."""
    rid = f"{GENERATE_RID_PREFIX}{uuid.uuid4().hex}"
    payload = {
        "rid": rid,
        "input_ids": prompt_ids,
        "sampling_params": {**sampling, "sampling_seed": seed},
    }
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
) -> list[dict[str, Any]]:
    """One sample's turns, in order: each turn's prompt is everything before it, the earlier
    turns as they were written (hsx_store/generated.py `closed_turn`). A turn cut at
    max_new_tokens ends the conversation."""
    segments, turn_end = prompt["segments"], prompt["turn_end"]
    params = {**sampling, "stop_token_ids": turn_end[:1]}  # the server stops where turns end
    ids: list[int] = []
    turns: list[dict[str, Any]] = []
    for segment in segments:
        ids += segment
        turn = generate_one(server, ids, params, seed, timeout)
        turns.append(turn)
        if turn["finish_reason"] == "length":
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
) -> dict[str, Any]:
    """One sample's record entry: its turns, or the error the server gave `attempts` times.
    A server that is gone raises (requests' errors): not the sample's fault."""
    entry = {
        "sample_id": sample["sample_id"],
        "seed": sample["seed"],
        "prompt": prompt["prompt"],
        "segments": prompt["segments"],
        "turn_end": prompt["turn_end"],
        **({"tools": prompt["tools"]} if "tools" in prompt else {}),
    }
    error = None
    for _ in range(attempts):
        try:
            return {
                **entry,
                "turns": write_turns(server, prompt, sampling, sample["seed"], timeout),
            }
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
    ) -> None:
        self.sampling, self.seed = config.sampling_params(), config.seed
        self.started_at, self._started = time.time(), time.monotonic()
        self.futures: list[Future[dict[str, Any]]] = [
            pool.submit(write_sample, server, p, s, self.sampling, attempts, timeout)
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
