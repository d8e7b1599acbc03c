"""The responses a job's servers generated, kept in the store's location before their capture.

    keep = GeneratedParts(store.group.store)
    keep.put_prompts(k, prompts)               # the driver: part k's prompts, before it is queued
    keep.put_responses(k, record)              # the worker that won part k's claim: once
    record = keep.responses(k)                 # None until then
    for conversation in read_conversations(url):   # anyone: the generated data on its own
        ...

One JSON object per part under `generation/` beside the Zarr arrays (zarr ignores keys that are
no node of its hierarchy). A responses object is written once, after its generation is whole,
by the worker whose claim on the part won: it is what makes a part's generation durable; the
driver plans the part's samples from it, a resume re-uses it, a lost worker never makes the part
generate again. Once, by the store: the write only creates (If-None-Match on S3), so the upload
of a claimant lost mid-write that lands late, or a retried upload, is never replaced by the
next holder's. Fields: docs/design/generation.md.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from zarr.abc.store import Store as ZarrStore
from zarr.core.buffer import default_buffer_prototype
from zarr.core.buffer.cpu import Buffer
from zarr.core.sync import sync

PREFIX = "generation"


def _key(kind: str, part: int) -> str:
    return f"{PREFIX}/{kind}-{part:08d}.json"


class GeneratedParts:
    """Reads and writes the `generation/` objects of one store location (local or object)."""

    def __init__(self, location: ZarrStore) -> None:
        self.location = location

    def put_prompts(self, part: int, prompts: list[dict[str, Any]]) -> None:
        self._put(_key("prompts", part), {"part": part, "prompts": prompts})

    def prompts(self, part: int) -> list[dict[str, Any]]:
        doc = self._get(_key("prompts", part))
        if doc is None:
            raise FileNotFoundError(f"{_key('prompts', part)}: no prompts stored for this part")
        return list(doc["prompts"])

    def put_responses(self, part: int, record: Mapping[str, Any]) -> None:
        """Part `part`'s generation, unless one is there already (then that one stays: the
        first to land is the part's, as the module doc says)."""
        self._put(_key("responses", part), {"part": part, **record}, create=True)

    def responses(self, part: int) -> dict[str, Any] | None:
        """Part `part`'s generation, once durable; None before."""
        return self._get(_key("responses", part))

    def parts(self) -> list[int]:
        """The parts whose generation is durable, ascending."""

        async def listed() -> list[str]:  # a local store lists folders, not name prefixes
            return [key async for key in self.location.list_prefix(f"{PREFIX}/")]

        names = [Path(key).stem for key in sync(listed())]
        return sorted(int(n.split("-")[1]) for n in names if n.startswith("responses-"))

    def _put(self, key: str, doc: Mapping[str, Any], create: bool = False) -> None:
        data = Buffer.from_bytes(json.dumps(doc, separators=(",", ":")).encode())
        # Create-only: the local store's exclusive create, or hsx_store/location.py's create
        # PUT, retried like every PUT of ours (one that finds the object there is done).
        write = self.location.set_if_not_exists if create else self.location.set
        sync(write(key, data))

    def _get(self, key: str) -> dict[str, Any] | None:
        buf = sync(self.location.get(key, prototype=default_buffer_prototype()))
        return None if buf is None else json.loads(buf.to_bytes())


def closed_turn(output_ids: list[int], finish_reason: str, turn_end: list[int]) -> list[int]:
    """A written turn's tokens as a sample holds them: as the server returned them, followed
    by the turn end if the turn stopped without it (a stop string, or eos in a chat); a turn
    cut at max_new_tokens gets none."""
    if finish_reason == "stop" and turn_end and output_ids[-len(turn_end) :] != turn_end:
        return [*output_ids, *turn_end]
    return list(output_ids)


def conversation(prompt: list[dict[str, Any]] | str, texts: list[str]) -> dict[str, Any]:
    """The prompt with the written turns' texts in place: messages, or a text."""
    if isinstance(prompt, str):
        return {"text": prompt + texts[0]}
    written, messages = iter(texts), []
    for m in prompt:
        if m["content"] is None:
            text = next(written, None)
            if text is None:  # the conversation ended early (a turn cut at max_new_tokens)
                break
            m = {**m, "content": text}
        messages.append(m)
    return {"messages": messages}


def read_conversations(
    url: str | Path, storage_options: Mapping[str, Any] | None = None
) -> Iterator[dict[str, Any]]:
    """Every generated sample of the store at `url`, in plan order, as a conversation: the
    prompt (messages or text, and its row's tools) with the written turns in place (an image
    part as `{"type": "image", "digest": ...}`: ImageBlobs(store).get(digest)), each turn's
    token ids and finish reason, the seed, the sampling parameters and the model that wrote
    it. Samples whose generation failed are left out (the store's `rejected` names them
    and why); a sample the plan rejected (a cut or empty turn) is here as it was written."""
    from hsx_store.format import open_group

    group = open_group(url, "r", storage_options)
    keep = GeneratedParts(group.store)
    for part in keep.parts():
        record = keep.responses(part)
        assert record is not None
        for sample in record["samples"]:
            if "error" in sample:
                continue
            turns = sample["turns"]
            yield {
                "id": sample["sample_id"],
                **conversation(sample["prompt"], [t["text"] for t in turns]),
                **({"tools": sample["tools"]} if "tools" in sample else {}),
                "turns": turns,  # each: output_ids, finish_reason, text
                "seed": sample["seed"],
                "sampling": record["sampling"],
                "model": record["model"],
            }
