"""The planning step: turn the prompt data named by `DataConfig` into tokenized samples and rejects.

    for item in PlanStream(config.data, config.model.path, planners=8):   # streamed, in order
        ...  # a Sample (accepted) or a Reject in input order, a PartEnd after each part
    plan = build_plan(config.data, config.model.path)                     # all of it, in memory

Planning is data-parallel: the inputs are cut into parts (cluster/plan_sources.py: byte ranges
of JSONL, row groups of Parquet, row ranges of datasets) and each part is read, checked,
templated and tokenized by a Ray task on a node that holds the inputs at their paths (the
nodes are probed first; `planners` parts at a time, default one per CPU of those nodes; 0: in
this process). Results are consumed in part order, so ids, duplicates and the store are the
same whatever the parallelism; only the ids seen so far and `planners` parts stay in memory.
`source_hashes(data)` and `chat_template_text(data, model_path)` give the sources' sha256 and
`plan.chat_template` without planning, for resume checks.

Nothing here raises for a bad row: every row is either accepted or rejected with a reason, in
input order. `PlanError` is only for an unusable input as a whole: a missing path, a format
that cannot be told or read, a missing chat template file, a model without tokenizer/config.json.

## Inputs

`data.paths` are read in order. `data.format: auto` tells each path's format by its name:
`.jsonl` / `.json` (JSON Lines, one object per line, not a JSON array), `.parquet`, or a directory
written by `datasets` `save_to_disk` (`hf`: a Dataset, or a DatasetDict from which `data.split` is
taken). JSONL is read as bytes line by line (blank lines are not rows); Parquet in record batches
with only the id/text/messages columns; HF datasets memory-mapped through `load_from_disk`, so
memory stays bounded by the tokenized output. `plan.sources` records each path with its format,
row count and SHA-256 (of the file; of a dataset directory: of every file in it, by relative path)
so a resumed job can tell that its input changed.

## Rows and sample ids

A row holds exactly one of
- `text_field` (default `text`): a string, tokenized with the model's tokenizer and its special
  tokens (`add_special_tokens=True`); or
- `messages_field` (default `messages`): a non-empty list of `{"role": str, "content": str}`,
  rendered with the chat template (`add_generation_prompt=False`) and tokenized without adding
  special tokens (the template writes them). Other message keys are passed to the template;
  keys whose value is null are dropped, since Parquet / HF datasets give every message every key
  of the column's struct.

A null field counts as absent (columnar formats have every column in every row).

The sample id is `row[id_field]` (default `id`; a string or an integer, written as a string) or,
when the row has none, `"<file name>:<row>"` where row is the 1-based line number for JSONL and
the 0-based row index for Parquet and HF datasets (the dataset directory's name stands for the
file name). Rejected rows are reported under the same id, or under `"<file name>:<row>"` when the
id itself is unusable. An id belongs to the first row that carries it, accepted or not: a later
row with the same id is rejected, so ids are unique across accepted and rejected rows.

## Loss masks

One uint8 per token. `loss_mask: all`: every token is 1. `loss_mask: assistant` (default): text
rows are all 1; chat rows have 1 on the assistant turns only, found one of two ways:
- the template has `{% generation %}` markers (and the tokenizer is a fast one): transformers'
  `apply_chat_template(..., return_assistant_tokens_mask=True)`, i.e. every token that overlaps
  a generation block (typically the content and the end-of-turn token);
- otherwise from the conversation's one rendering (cluster/loss_mask.py): each assistant turn's
  content and its end-of-turn token(s) (ChatML's `<|im_end|>` without the `\n` the template
  writes after it, which the model never generates), located in characters from how the
  template frames an assistant turn (learned once per template from probe conversations) and
  mapped to tokens by the tokenizer's offsets. A template that renders a turn other than as
  written (e.g. drops the reasoning of earlier assistant turns) gets the row rejected: the fix
  is `loss_mask: all` or a template file (`data.chat_template`) with `{% generation %}` markers.

## Reject reasons

Field names below are the configured ones (`id`, `text`, `messages` by default); `<type>` is
`null`, `bool`, `int`, `float`, `string`, `list` or `object`.

| reason | when |
|---|---|
| `not valid UTF-8` | a JSONL line is not UTF-8 |
| `malformed JSON: <json error>` | a JSONL line is not JSON |
| `row must be a JSON object, got <type>` | a JSONL line holds e.g. a list |
| `id must be a string or an integer, got <type>` | |
| `id is an empty string` | |
| `duplicate sample id (first seen at <file>:<row>)` | an earlier row has the same id |
| `row has both text and messages` | |
| `row has neither text nor messages` | |
| `text must be a string, got <type>` | |
| `empty text` | |
| `text is only whitespace` | |
| `messages must be a list, got <type>` | |
| `empty messages` | |
| `messages[i] must be an object, got <type>` | |
| `messages[i].role must be a string, got <type>` | (checked before content) |
| `messages[i].content must be a string, got <type>` | e.g. a list of content parts |
| `messages[i].role <role> is not one of data.roles [...]` | a role the job does not allow |
| `the model has no chat template; set data.chat_template` | a chat row, no template |
| `chat template error: <error>` | the template raised (e.g. roles must alternate) |
| `no assistant turn to train on` | `loss_mask: assistant`, no role `assistant` |
| `the chat template does not render assistant turn <k> as written ...` (*) | no markers |
| `cannot tell how the chat template renders assistant turns (...); ...` | probes failed |
| `the tokenizer merges tokens across an edge of assistant turn <k> ...` | slow tokenizer |
| `the chat template marks no assistant tokens` | `loss_mask: assistant`, an all-0 mask |
| `zero tokens` | the tokenizer produced no token |
| `<n> tokens > max_length <m>` | too long; prompts are never truncated |
| `token id <i> is outside the model's vocabulary [0, <v>)` | a token the embedding lacks |

(*) in full: `the chat template does not render assistant turn <k> as written (header, content,
turn end); cannot mark its tokens (use loss_mask: all or a template with {% generation %}
markers)`; see "Loss masks" above.

The vocabulary size is `text_config.vocab_size` of the model's config.json if present, else
`vocab_size`: a tokenizer's added tokens can lie beyond the embedding.

Rows are tokenized in batches of `BATCH_ROWS` with the tokenizer's batch call.
"""

from __future__ import annotations

import functools
import logging
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from typing import Any

import numpy as np

from cluster.config import DataConfig
from cluster.plan_encode import Encoder, chat_template_text, parse_row
from cluster.plan_sources import (
    Part,
    PlanError,
    read_part,
    resolve_source,
    sha256_source,
    source_hashes,
    split_parts,
)

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


@dataclass(frozen=True)
class Sample:
    sample_id: str
    input_ids: np.ndarray  # int32
    loss_mask: np.ndarray  # uint8, same length


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


@functools.lru_cache(maxsize=4)
def _encoder(data_json: str, model_path: str, trust_remote_code: bool) -> Encoder:
    """One per planning process and job: loading a tokenizer costs up to seconds."""
    return Encoder.load(DataConfig.model_validate_json(data_json), model_path, trust_remote_code)


def plan_part(part: Part, data_json: str, model_path: str, trust_remote_code: bool) -> PartResult:
    """Read, check and encode one part (a Ray task, or called in-process)."""
    data = DataConfig.model_validate_json(data_json)
    encoder = _encoder(data_json, model_path, trust_remote_code)
    raw, numbers = read_part(part, data)
    result = PartResult(numbers)
    ids: list[np.ndarray] = []
    masks: list[np.ndarray] = []
    while chunk := list(islice(raw, BATCH_ROWS)):
        rows = [parse_row(value, reason, data) for _, value, reason in chunk]
        for (number, _, _), row, encoded in zip(chunk, rows, encoder.encode(rows), strict=True):
            reason = encoded if isinstance(encoded, str) else None
            result.rows.append((number, row.own_id, reason))
            if reason is None:
                ids.append(encoded[0])
                masks.append(encoded[1])
                result.lengths.append(len(encoded[0]))
    if ids:
        result.input_ids, result.loss_mask = np.concatenate(ids), np.concatenate(masks)
    return result


class PlanStream:
    """The plan as a stream of `Sample`s and `Reject`s in input order, with a `PartEnd` after
    each part's (a consumer may wait long for the next part); after it is exhausted, `sources`
    holds each input's record (path, format, rows) and `chat_template` is set.

    `planners`: 0 plans in this process, one part at a time; otherwise parts are planned as Ray
    tasks, that many at once (None: one per CPU of those nodes), on the nodes that hold every
    input at its path (found first; `nodes` lists them), round robin."""

    def __init__(
        self,
        data: DataConfig,
        model_path: str | Path,
        trust_remote_code: bool = False,
        planners: int | None = 0,
    ) -> None:
        self.data, self.planners = data, planners
        self._args = (data.model_dump_json(), str(model_path), trust_remote_code)
        self._sources = [resolve_source(p, data.format) for p in data.paths]
        encoder = _encoder(*self._args)  # fails here, not in a task, for a bad model/template
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
            name = part.path.name
            base = numbers[part.source]
            offsets = np.cumsum([0, *result.lengths])
            encoded = 0  # rows of this part the encoder accepted so far
            for number, own_id, reason in result.rows:
                tokens = (
                    slice(int(offsets[encoded]), int(offsets[encoded + 1]))
                    if reason is None
                    else None
                )
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
                yield Sample(sample_id, result.input_ids[tokens], result.loss_mask[tokens])
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

    def _results(self) -> Iterator[tuple[Part, PartResult]]:
        """Each part's result, in part order, with at most `planners` parts in flight."""
        if self.planners == 0:
            for part in self.parts:
                yield part, plan_part(part, *self._args)
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
            window.append((part, task.options(scheduling_strategy=node).remote(part, *self._args)))
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
    """The whole plan in memory (tests, tools, small jobs; the driver streams instead)."""
    stream = PlanStream(data, model_path, trust_remote_code, planners)
    ids, input_ids, masks, rejected = [], [], [], []
    for item in stream:
        if isinstance(item, Reject):
            rejected.append(item.to_json())
        elif isinstance(item, Sample):
            ids.append(item.sample_id)
            input_ids.append(item.input_ids)
            masks.append(item.loss_mask)
    sources = [{**src, "sha256": sha256_source(Path(src["path"]))} for src in stream.sources]
    return Plan(ids, input_ids, masks, rejected, sources, stream.chat_template)
