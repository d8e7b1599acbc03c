"""The planning step: turn the prompt data named by `DataConfig` into tokenized samples and rejects.

    stream = PlanStream(config.data, config.model.path, planners=8,
                        images_to=(config.store.url, config.store.storage_options))
    for item in stream:   # streamed, in order
        ...  # a Sample (accepted) or a Reject in input order, a PartEnd after each part
    plan = build_plan(config.data, config.model.path)                     # all of it, in memory

Each part of the inputs (cluster/plan_sources.py) is planned by a Ray task on a node that holds
them (`planners` parts at a time; 0: in this process); results are consumed in part order, so
the plan is the same whatever the parallelism. A part's images go from its planning task
straight into the store (`images_to`), before its result is returned: only the rows reach the
driver, and every image is stored before a row naming it is added. `source_hashes(data)` and
`chat_template_text(data, model_path)` give what a resume compares, without planning.

Nothing here raises for a bad row: every row is accepted or rejected with a reason, in input
order. `PlanError` is only for an unusable input as a whole.

Inputs, sample ids, loss masks and every reject reason: docs/design/planning.md.
"""

from __future__ import annotations

import functools
import logging
import socket
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from typing import Any

import numpy as np
from zarr.core.sync import sync

from actors.config import GenerateConfig
from cluster.config import DataConfig
from cluster.conversation import by_digest
from cluster.images import MROPE, ExpandedRow, ImageSources, text_positions
from cluster.plan_encode import Encoder, PromptEncoded, Row, chat_template_text, parse_row
from cluster.plan_sources import (
    Part,
    PlanError,
    read_part,
    resolve_source,
    sha256_source,
    source_hashes,
    split_parts,
)
from hsx_store.images import ImageBlobs, SampleImage
from hsx_store.location import mask_secrets, open_location

__all__ = [
    "PartEnd",
    "Plan",
    "PlanError",
    "PlanStream",
    "Reject",
    "Sample",
    "build_plan",
    "chat_template_text",
    "source_hashes",
]

log = logging.getLogger("cluster.plan")

BATCH_ROWS = 1000  # rows per tokenizer batch call
# A row the planner raised for: the row is rejected and the job goes on, but it is our bug
# (every bad row has a reason of its own), logged with its traceback.
PLANNER_FAULT = "the planner failed on this row, a bug to report ({error})"


@dataclass(frozen=True)
class Sample:
    sample_id: str
    input_ids: np.ndarray  # int32
    loss_mask: np.ndarray  # uint8, same length
    # generating: {"prompt": messages (null contents: turns to write) or text, "segments":
    # the lengths of the tokens before each turn to write, "tools" and "images" where the row
    # has them} (`_prompt_record`); its tokens hold one image token per image
    prompt: dict[str, Any] | None = None
    # An M-RoPE model's (`Encoder.position_ids`): [P, 3] int32, for every sample
    position_ids: np.ndarray | None = None
    images: tuple[SampleImage, ...] = ()  # its image spans, in prompt order (the images:
    # in the store already, or, planned without `images_to`, nowhere)


@dataclass(frozen=True)
class Reject:
    sample_id: str
    reason: str

    def to_json(self) -> dict[str, str]:
        return {"sample_id": self.sample_id, "reason": self.reason}


@dataclass(frozen=True)
class PartEnd:
    """Every item of one part has been yielded: a moment to make them visible."""


@dataclass(frozen=True)
class Plan:
    sample_ids: list[str]
    input_ids: list[np.ndarray]  # int32, one per accepted sample, in input order
    loss_masks: list[np.ndarray]  # uint8, same lengths
    rejected: list[dict[str, str]]  # {"sample_id", "reason"} per rejected row, in input order
    sources: list[dict[str, Any]]  # per input path: path, format, sha256, rows
    chat_template: str | None  # the template text used for chat rows; None: none available
    # per accepted sample, as its Sample holds them
    position_ids: list[np.ndarray | None] = field(default_factory=list)
    images: list[tuple[SampleImage, ...]] = field(default_factory=list)

    @property
    def total_tokens(self) -> int:
        return sum(len(ids) for ids in self.input_ids)


@dataclass
class PartResult:
    """One part's rows in order: (row number in the part, own id or None, reason or None), and
    the accepted rows' tokens back to back (`lengths` each), compact for Ray's object store."""

    numbers: int  # row numbers the part spans (JSONL: its lines, blank ones too)
    rows: list[tuple[int, str | None, str | None]] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)
    input_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    loss_mask: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint8))
    # generating: each accepted row's prompt record (`_prompt_record`)
    prompts: list[dict[str, Any]] = field(default_factory=list)
    # Rows with images, by their index among the accepted: M-RoPE positions [P, 3] (an M-RoPE
    # model's other rows get three aranges on arrival), image spans (the images themselves
    # were put into the store by the task).
    positions: dict[int, np.ndarray] = field(default_factory=dict)
    images: dict[int, tuple[SampleImage, ...]] = field(default_factory=dict)


@functools.lru_cache(maxsize=4)
def _encoder(
    data_json: str, model_path: str, trust_remote_code: bool, generate_json: str | None = None
) -> Encoder:
    """One per planning process and job: loading a tokenizer costs up to seconds."""
    generate = GenerateConfig.model_validate_json(generate_json) if generate_json else None
    data = DataConfig.model_validate_json(data_json)
    return Encoder.load(data, model_path, trust_remote_code, generate)


def _image_blobs(url: str, options: dict[str, Any] | None) -> ImageBlobs:
    """Where this part's images go: the job's store, which must be there as this node sees
    it (a local path another node cannot see would quietly become a folder of its own)."""
    location = open_location(url, options)
    if isinstance(location, str | Path):  # no LocalStore call: its first one makes the folder
        there = (Path(location) / "zarr.json").is_file()
    else:
        there = sync(location.exists("zarr.json"))
    if not there:
        raise PlanError(
            f"{mask_secrets(url, options)}: no store there as {socket.gethostname()} (planning a "
            "part) sees it: a local store must be on storage every node mounts at the same path "
            "(or use object storage)"
        )
    return ImageBlobs(location)


def plan_part(
    part: Part,
    data_json: str,
    model_path: str,
    trust_remote_code: bool,
    generate_json: str | None = None,
    images_to: tuple[str, dict[str, Any]] | None = None,
    image_dir: str | None = None,
) -> PartResult:
    """Read, check and encode one part (a Ray task, or called in-process). Each accepted
    row's images are put into the store at `images_to` (its URL and storage options; None:
    nowhere) before this returns. Relative image paths are read from `image_dir` (default: the
    folder of the input as `data.paths` names it, from this process's directory)."""
    data = DataConfig.model_validate_json(data_json)
    encoder = _encoder(data_json, model_path, trust_remote_code, generate_json)
    raw, numbers = read_part(part, data)
    result = PartResult(numbers)
    ids: list[np.ndarray] = []
    masks: list[np.ndarray] = []
    keep_in = None
    if images_to is not None and encoder.vision is not None:  # a text model has no images
        keep_in = _image_blobs(*images_to)
    folder = Path(image_dir) if image_dir else input_folder(data.paths[part.source])
    images = encoder.image_sources(folder, keep_in)
    while chunk := list(islice(raw, BATCH_ROWS)):
        rows = [_parsed(value, reason, data) for _, value, reason in chunk]
        encoded_rows = _encoded(encoder, rows, images)
        for (number, _, _), row, encoded in zip(chunk, rows, encoded_rows, strict=True):
            reason = encoded if isinstance(encoded, str) else None
            result.rows.append((number, row.own_id, reason))
            if isinstance(encoded, ExpandedRow):
                _add_images(result, encoded)
                encoded = (encoded.input_ids, encoded.loss_mask)
            if reason is None:
                ids.append(encoded[0])
                masks.append(encoded[1])
                result.lengths.append(len(encoded[0]))
                if encoder.generate is not None:
                    result.prompts.append(_prompt_record(encoder.prompt_of(row), row, encoded))
    if ids:
        result.input_ids, result.loss_mask = np.concatenate(ids), np.concatenate(masks)
    return result


def _parsed(value: Any, reason: str | None, data: DataConfig) -> Row:
    """`parse_row`, whose failure is its row's reject (PLANNER_FAULT), never the plan's."""
    try:
        return parse_row(value, reason, data)
    except Exception as exc:
        log.exception("parsing a row failed")
        return Row(None, PLANNER_FAULT.format(error=f"{type(exc).__name__}: {exc}"))


def _encoded(encoder: Encoder, rows: list[Row], images: ImageSources) -> list[Any]:
    """`encoder.encode(rows, images)`; where it raises, row by row, a row it raises for
    rejected (PLANNER_FAULT) and the others encoded as ever."""
    try:
        return encoder.encode(rows, images)
    except Exception:
        log.exception("encoding %d rows failed; encoding them one by one", len(rows))
    results: list[Any] = []
    for row in rows:
        try:
            results += encoder.encode([row], images)
        except Exception as exc:
            log.exception("encoding a row failed")
            results.append(PLANNER_FAULT.format(error=f"{type(exc).__name__}: {exc}"))
    return results


def _prompt_record(
    prompt: list[dict[str, Any]] | str, row: Row, encoded: PromptEncoded
) -> dict[str, Any]:
    """A prompt as a generation part keeps it: its messages (or text), its segments' lengths,
    its row's tools, its images (digest, rows, grid: their spans follow from the tokens). Each
    image part names its image by digest (in the store), not by its source: a data URL would
    be the whole image again, in the prompts and in every sample's responses."""
    record: dict[str, Any] = {"prompt": prompt, "segments": encoded[2]}
    if row.tools:
        record["tools"] = row.tools
    if images := encoded[3]:
        record["prompt"] = by_digest(prompt, [im.digest for im in images])
        record["images"] = [
            {"digest": im.digest, "length": im.length, "grid_thw": list(im.grid_thw)}
            for im in images
        ]
    return record


def _add_images(result: PartResult, row: ExpandedRow) -> None:
    """A row with images, the next accepted one of `result`: its positions and spans."""
    k = len(result.lengths)
    result.images[k] = row.images
    if row.position_ids is not None:
        result.positions[k] = row.position_ids


def input_folder(path: str) -> Path:
    """The folder an input's relative image paths are read from: its own, as the user named
    it (symlinks not resolved: a hub snapshot's files are links into its blobs/), absolute."""
    return Path(path).absolute().parent


class PlanStream:
    """The plan as a stream of `Sample`s and `Reject`s in input order, with a `PartEnd` after
    each part's (a consumer may wait long for the next part); after it is exhausted, `sources`
    holds each input's record (path, format, rows) and `chat_template` is set.

    `planners`: 0 plans in this process, one part at a time; otherwise parts are planned as Ray
    tasks, that many at once (None: one per CPU of those nodes), on the nodes that hold every
    input at its path (found first; `nodes` lists them), round robin. `generate`: each Sample
    is a prompt to generate from (its `prompt`, its tokens, a mask of zeros). `images_to`:
    the store (URL, storage options) each planning task puts its part's images into before it
    returns (hsx_store/images.py); None: nowhere (a dry run, a plan in memory)."""

    def __init__(
        self,
        data: DataConfig,
        model_path: str | Path,
        trust_remote_code: bool = False,
        planners: int | None = 0,
        generate: GenerateConfig | None = None,
        images_to: tuple[str, dict[str, Any]] | None = None,
    ) -> None:
        self.data, self.planners = data, planners
        self._args = (
            data.model_dump_json(),
            str(model_path),
            trust_remote_code,
            generate.model_dump_json() if generate else None,
        )
        self._images_to = None if images_to is None else (str(images_to[0]), images_to[1] or {})
        # Here, not in a task: a relative path is this process's directory's.
        self._image_dirs = [str(input_folder(p)) for p in data.paths]
        self._sources = [resolve_source(p, data.format) for p in data.paths]
        self._names = source_names([src.path for src in self._sources])
        encoder = _encoder(*self._args)  # fails here, not in a task, for a bad model/template
        self.encoder = encoder
        self.chat_template = encoder.template
        self.sources: list[dict[str, Any]] = []
        self.accepted = self.rejected = self.tokens = 0
        self.parts = list(split_parts(self._sources, data))  # of about equal size each
        self.parts_done = 0
        self.nodes: list[str] = []  # the Ray nodes planning runs on (none: this process)

    def __iter__(self) -> Iterator[Sample | Reject | PartEnd]:
        first_seen: dict[str, str] = {}  # sample id -> the location of its first row
        numbers = [0] * len(self._sources)  # row numbers spanned so far, per source
        counts = [0] * len(self._sources)  # rows read (blank JSONL lines are none)
        for part, result in self._results():
            name = self._names[part.source]
            base = numbers[part.source]
            offsets = np.cumsum([0, *result.lengths])
            encoded = 0  # rows of this part the encoder accepted so far
            for number, own_id, reason in result.rows:
                tokens = (
                    slice(int(offsets[encoded]), int(offsets[encoded + 1]))
                    if reason is None
                    else None
                )
                prompt = result.prompts[encoded] if result.prompts and reason is None else None
                encoded += reason is None
                loc = f"{name}:{base + number}"
                sample_id = own_id or loc
                if sample_id in first_seen:  # an id belongs to its first row, accepted or not
                    reason = f"duplicate sample id (first seen at {first_seen[sample_id]})"
                else:
                    first_seen[sample_id] = loc
                if reason is not None or tokens is None:
                    self.rejected += 1
                    yield Reject(sample_id, str(reason))
                    continue
                self.accepted += 1
                self.tokens += tokens.stop - tokens.start
                yield self._sample(sample_id, result, tokens, prompt, encoded - 1)
            numbers[part.source] += result.numbers
            counts[part.source] += len(result.rows)
            self.parts_done += 1
            yield PartEnd()
        self.sources = [
            {"path": str(src.path), "format": src.format, "rows": count}
            for src, count in zip(self._sources, counts, strict=True)
        ]
        log.info(
            "plan: %d samples accepted, %d rejected, %d tokens",
            self.accepted,
            self.rejected,
            self.tokens,
        )

    def _sample(
        self,
        sample_id: str,
        result: PartResult,
        tokens: slice,
        prompt: dict[str, Any] | None,
        k: int,
    ) -> Sample:
        """The accepted row `k` of a part's result, its tokens at `tokens`."""
        if not result.images and self.encoder.position_ids is None:  # a text job's
            return Sample(sample_id, result.input_ids[tokens], result.loss_mask[tokens], prompt)
        positions = result.positions.get(k)
        if positions is None and self.encoder.position_ids == MROPE:
            positions = text_positions(tokens.stop - tokens.start)
        return Sample(
            sample_id,
            result.input_ids[tokens],
            result.loss_mask[tokens],
            prompt,
            positions,
            result.images.get(k, ()),
        )

    def _part_args(self, part: Part) -> tuple[Any, ...]:
        """plan_part's arguments for `part`."""
        return (part, *self._args, self._images_to, self._image_dirs[part.source])

    def _results(self) -> Iterator[tuple[Part, PartResult]]:
        """Each part's result, in part order, with at most `planners` parts in flight."""
        if self.planners == 0:
            for part in self.parts:
                yield part, plan_part(*self._part_args(part))
            return
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        cpus = _nodes_holding([str(src.path) for src in self._sources])
        self.nodes = sorted(cpus)
        at_once = self.planners or sum(cpus.values())
        # No CPU reserved: the window bounds how many run, and a task never keeps a worker
        # from being placed on its node.
        task = ray.remote(num_cpus=0)(plan_part)
        window: deque[tuple[Part, Any]] = deque()
        for k, part in enumerate(self.parts):
            node = NodeAffinitySchedulingStrategy(self.nodes[k % len(self.nodes)], soft=False)
            ref = task.options(scheduling_strategy=node).remote(*self._part_args(part))
            window.append((part, ref))
            if len(window) >= at_once:
                yield _get(*window.popleft())
        while window:
            yield _get(*window.popleft())


def _nodes_holding(paths: list[str]) -> dict[str, int]:
    """The alive Ray nodes with CPUs where every path exists, with their CPU counts. Raises
    PlanError naming the paths when no node has them all."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    nodes = {
        n["NodeID"]: int(n["Resources"]["CPU"])
        for n in ray.nodes()
        if n["Alive"] and n["Resources"].get("CPU", 0) >= 1
    }
    probe = ray.remote(num_cpus=0)(_all_exist)
    found = ray.get(
        [
            probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n, soft=False)).remote(
                paths
            )
            for n in nodes
        ]
    )
    holding = {n: cpus for (n, cpus), ok in zip(nodes.items(), found, strict=True) if ok}
    if not holding:
        raise PlanError(f"no Ray node can read every input at its path: {paths}")
    if len(holding) < len(nodes):
        log.info("planning on the %d of %d nodes that hold the inputs", len(holding), len(nodes))
    return holding


def source_names(paths: list[Path]) -> list[str]:
    """Each input's name in the ids of its rows that have none (`<name>:<row>`): its file name,
    or as many trailing parts of its path as tell it from every other input (a/train.jsonl,
    b/train.jsonl). It depends on the inputs' paths alone, so a resume names rows alike."""
    names = []
    for path in paths:
        others = [q.parts for q in paths if q != path]
        n = 1
        while n < len(path.parts) and any(q[-n:] == path.parts[-n:] for q in others):
            n += 1
        names.append("/".join(path.parts[-n:]))
    return names


def _all_exist(paths: list[str]) -> bool:
    return all(Path(p).exists() for p in paths)


def _get(part: Part, ref: Any) -> tuple[Part, PartResult]:
    """A part's result; a PlanError raised in the task is raised here as itself."""
    import ray

    try:
        return part, ray.get(ref)
    except ray.exceptions.RayTaskError as exc:
        if isinstance(exc.cause, PlanError):
            raise exc.cause from None
        raise


def build_plan(
    data: DataConfig,
    model_path: str | Path,
    trust_remote_code: bool = False,
    planners: int | None = 0,
) -> Plan:
    """The whole plan in memory (tests, tools, small jobs; the driver streams instead). Its
    images are read and checked, and stored nowhere."""
    stream = PlanStream(data, model_path, trust_remote_code, planners)
    ids, input_ids, masks, rejected, positions, images = [], [], [], [], [], []
    for item in stream:
        if isinstance(item, Reject):
            rejected.append(item.to_json())
        elif isinstance(item, Sample):
            ids.append(item.sample_id)
            input_ids.append(item.input_ids)
            masks.append(item.loss_mask)
            positions.append(item.position_ids)
            images.append(item.images)
    sources = [{**src, "sha256": sha256_source(Path(src["path"]))} for src in stream.sources]
    return Plan(
        ids,
        input_ids,
        masks,
        rejected,
        sources,
        stream.chat_template,
        positions,
        images,
    )
