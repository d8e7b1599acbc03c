"""The job configuration: one YAML file, validated field by field, with command-line overrides.

    config = load_config("ray_configs/demo_job.yaml", ["store.url=out/x.zarr", "worker.inflight=4"])

Every field has a default except `model.path`, `data.paths` and `store.url`; unknown fields
are errors; errors name the field. Relative paths resolve against the current directory, except
in a job `ray job submit` started: there they are refused (see resolve_paths). The config is
then held to its model's config.json (fit_to_model: the aux layers, the longest request).
Reference (generated from the field docstrings): docs/configuration.md.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator

from actors.config import Section, WorkerJobConfig
from cluster.model_limits import longest_input
from hsx_store.layers import LayerIdsError, ModelConfigError, model_config, resolve_layer_ids
from hsx_store.location import OBSTORE_MAX_BACKOFF, duration_s, is_remote, obstore_options


class DataConfig(Section):
    """The prompts, and how they become token ids and loss masks (docs/design/planning.md)."""

    paths: list[str] = Field(min_length=1)
    """Input files, read in order: JSON Lines (.jsonl, .json), Parquet (.parquet), or
    directories saved by HF datasets (`save_to_disk`)."""
    format: Literal["auto", "jsonl", "parquet", "hf"] = "auto"
    """auto: each path's format from its name (a directory is a datasets directory)."""
    split: str = "train"
    """The split of a saved DatasetDict."""
    id_field: str = "id"
    """The field holding a row's id (a string or an integer); a row without one gets
    `<file name>:<row>`."""
    text_field: str = "text"
    """The field holding a text row's text. A row holds one of text_field, messages_field and
    conversations_field."""
    messages_field: str = "messages"
    """The field holding a chat row's OpenAI messages (`[{"role": ..., "content": ...}, ...]`,
    with tool calls, tool results, content parts (text, images), reasoning:
    docs/input-formats.md), rendered with the chat template."""
    conversations_field: str = "conversations"
    """The field holding a ShareGPT row's turns, `[{"from": ..., "value": ...}, ...]`."""
    tools_field: str = "tools"
    """The field holding a chat row's tool definitions (a list, or a JSON string of one),
    given to the chat template as transformers' `apply_chat_template(tools=...)` does."""
    row_schema: Literal["auto", "text", "openai", "sharegpt"] = "auto"
    """auto: each row's shape from the field it holds (text_field, messages_field or
    conversations_field) and its turns (`{from, value}`: ShareGPT, `{role, content}`: OpenAI,
    in either field); otherwise every row is read as that shape from its field."""
    roles: list[str] = Field(["system", "user", "assistant", "tool"])
    """The roles a message may have; a row with another is rejected."""
    chat_template: str = "model"
    """"model": the tokenizer's own chat template; otherwise the path of a Jinja template."""
    content_format: Literal["auto", "openai", "string"] = "auto"
    """How a list of content parts reaches the chat template. auto: as SGLang's server gives
    it (parts to a template that loops over a message's content or names images, the text
    parts joined by a space to any other); openai: always parts; string: always the text."""
    loss_mask: Literal["assistant", "all"] = "assistant"
    """assistant: loss on the assistant turns of chat rows (text rows: every token); all:
    every token."""
    max_length: int = Field(4096, ge=1)
    """Longer prompts are rejected, never truncated (a row with images: counted with each
    image's tokens, as the model's processor expands it). At most what one request to the
    model's server takes (its context length less 7: see Rules); left unset, 4096 or that,
    whichever is less."""
    images_field: str = "images"
    """The field holding a chat row's row-level image sources (LLaMA-Factory's multimodal
    rows, ShareGPT or OpenAI): each placed where its `image_tag` stands in the turns, in
    order; a row whose tags and images differ in number is rejected."""
    image_tag: str = Field("<image>", min_length=1)
    """The placeholder of a row-level image in a turn's text (LLaMA-Factory's)."""
    image_storage_options: dict[str, Any] | None = None
    """obstore settings for image parts held in object storage (`s3://bucket/key`, ...), as
    store.storage_options takes them; null: the planning nodes' environment (`AWS_*`)."""
    image_fetch_timeout_s: float = Field(30.0, gt=0)
    """An image part's fetch (http(s), object storage) not done this many seconds after it
    starts fails, however its bytes arrive, and its row is rejected."""
    image_max_bytes: int = Field(64 << 20, ge=1)
    """An image source larger than this (a file, a fetch, a data URL's bytes) is not read,
    and its row is rejected."""
    image_max_pixels: int = Field(89_478_485, ge=1)
    """An image whose header claims more pixels (width x height) than this is not decoded,
    and its row is rejected (the default: PIL's own decompression-bomb threshold; PIL refuses
    twice that whatever this says)."""
    image_roots: list[str] | None = None
    """The folders local image paths (relative, absolute, `file://`) must lie in, once
    resolved (links followed); another is rejected unread. null: the folder of the row's
    input; a list replaces it (name that folder too where relative paths are meant); `["/"]`:
    anywhere the planning nodes can read (docs/security.md)."""

    @field_validator("image_storage_options")
    @classmethod
    def _image_obstore_options(cls, options: dict[str, Any] | None) -> dict[str, Any] | None:
        if options is not None:
            obstore_options(options)  # what obstore would refuse later, named now
        return options


def store_write_bound_s(storage_options: dict[str, Any]) -> float:
    """The longest one chunk PUT to object storage can go on: its last retry starts by
    retry_timeout + max_backoff and runs at most the client timeout (hsx_store/location.py)."""
    client, retry, _ = obstore_options(storage_options)
    max_backoff = retry["backoff"].get("max_backoff", OBSTORE_MAX_BACKOFF)
    return (
        retry["retry_timeout"].total_seconds()
        + max_backoff.total_seconds()
        + duration_s(client["timeout"], "client_options.timeout")
    )


class QueueConfig(Section):
    """The shard lease queue and its time fence (docs/design/queue.md)."""

    lease_s: float = Field(300.0, gt=0)
    """A lease not renewed this long goes back to the queue."""
    margin_s: float | None = Field(None, gt=0)
    """A holder starts no store write later than lease_s - margin_s after asking for its last
    renewal, and nobody else writes the shard until margin_s after the lease expired; must
    exceed the longest a store write can take. null: that + 15 s on object storage (210 s with
    the default client options), lease_s / 2 on a local store."""
    shard_attempts: int = Field(3, ge=1)
    """Leases of a shard lost to failures before it is given up."""
    straggler_factor: float = Field(2.0, ge=1.0)
    """At the tail (nothing pending) an idle worker re-runs a shard leased longer than this x
    the median shard time (and straggler_min_s); the first commit wins."""
    straggler_min_s: float = Field(60.0, ge=0)
    """The least lease age for a tail duplicate."""


class DriverConfig(Section):
    """The driver: progress, the job's end, planning."""

    progress_interval_s: float = Field(10.0, gt=0)
    """How often the driver looks at the workers and the queue; on a terminal, a progress line
    each time."""
    log_interval_s: float = Field(30.0, gt=0)
    """Off a terminal (a `ray job submit` log, a file): a progress line this often, plus one on
    every change of state (a worker starts, is up or is lost; planning ends; a commit after a
    quiet spell)."""
    finish_grace_s: float = Field(60.0, ge=0)
    """Once every shard is done, workers still busy after this long (a straggler whose shard a
    duplicate committed) are stopped rather than waited for."""
    node_wait_s: float = Field(300.0, ge=0)
    """With no usable GPU node at all, wait this long for one to join before giving up."""
    planners: int | None = Field(None, ge=1)
    """Parts of the data planned at once, as Ray tasks on the nodes that hold every input at
    its path; null: one per CPU of those nodes. The plan is the same whatever the number."""


class JobConfig(WorkerJobConfig):
    """The whole job: what every worker reads (actors/config.py) and the driver's sections."""

    data: DataConfig
    queue: QueueConfig = QueueConfig()
    driver: DriverConfig = DriverConfig()

    @property
    def margin_s(self) -> float:
        """queue.margin_s, or its default for this store (see QueueConfig)."""
        if self.queue.margin_s is not None:
            return self.queue.margin_s
        if is_remote(self.store.url):
            return store_write_bound_s(self.store.storage_options) + 15.0
        return self.queue.lease_s / 2

    @model_validator(mode="after")
    def _fp8_from_bf16(self) -> JobConfig:
        if self.store.dtype == "fp8_e4m3" and self.model.dtype != "bfloat16":
            raise ValueError(
                f"store.dtype fp8_e4m3 quantizes a bfloat16 capture: set model.dtype bfloat16 "
                f"(not {self.model.dtype})"
            )
        return self

    @model_validator(mode="after")
    def _lease_timing(self) -> JobConfig:
        """The time fence's assumptions (cluster/shard_queue.py): every store write ends within
        the margin, the lease outlasts it, and heartbeats renew well before lease - margin."""
        lease, margin, beat = self.queue.lease_s, self.margin_s, self.worker.heartbeat_s
        bound = store_write_bound_s(self.store.storage_options) if is_remote(self.store.url) else 0
        if margin <= bound:
            raise ValueError(
                f"queue.margin_s ({margin:g} s) must exceed the longest a store write can take "
                f"({bound:g} s: client timeout + retry_timeout + max_backoff of "
                "store.storage_options)"
            )
        if lease <= margin:
            raise ValueError(
                f"queue.lease_s ({lease:g} s) must exceed queue.margin_s ({margin:g} s)"
            )
        if beat > (lease - margin) / 3:
            raise ValueError(
                f"worker.heartbeat_s ({beat:g} s) must be at most a third of queue.lease_s - "
                f"queue.margin_s ({lease - margin:g} s): writes stop that long after a renewal"
            )
        return self


class ConfigError(ValueError):
    """The job config is invalid; the message names every bad field."""


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """`section.field=value` pairs; the value is parsed as YAML (`[1, 2]`, `true`, `null`)."""
    for item in overrides:
        key, sep, value = item.partition("=")
        parts = key.strip().split(".")
        if not sep or len(parts) != 2 or not all(parts):
            raise ConfigError(f"override {item!r}: expected section.field=value")
        section = raw.setdefault(parts[0], {})
        if not isinstance(section, dict):
            raise ConfigError(f"override {item!r}: {parts[0]} is not a section")
        section[parts[1]] = yaml.safe_load(value) if value.strip() else ""
    return raw


# The fields that hold local paths, (section, field): read by the job, or written.
INPUT_FIELDS = (
    ("model", "path"),
    ("data", "paths"),
    ("data", "chat_template"),
    ("data", "image_roots"),
)
OUTPUT_FIELDS = (("store", "url"), ("worker", "dump_root"), ("worker", "log_root"))


def submitted_job() -> bool:
    """Whether this process is the entrypoint of a job `ray job submit` started (Ray gives it
    the job's config in this variable)."""
    return "RAY_JOB_CONFIG_JSON_ENV_VAR" in os.environ


def resolve_paths(raw: dict[str, Any], cwd: Path, submitted: bool) -> list[str]:
    """Make every relative local path in `raw` absolute against `cwd` (the workers, Ray actors,
    run in other directories); the problems, one per field.

    A submitted job's entrypoint runs in the copy of its working_dir that Ray made (deleted once
    unused, and apart on each node), not where the user submitted from. There a relative input
    is taken from that copy only if it came with the job (the demo's prompts); anything else
    relative is refused: an input the package left out, and every output (a store written into
    Ray's copy would be deleted with it)."""
    problems = []

    def resolve(where: str, value: Any, written: bool) -> Any:
        local = isinstance(value, str) and value and not is_remote(value)
        if not local or value.startswith("file://") or Path(value).is_absolute():
            return value
        path = cwd / value
        if submitted and written:
            problems.append(f"{where}: {value!r} is relative, and would be written into Ray's copy")
        elif submitted and not path.exists():
            problems.append(f"{where}: {value!r} is relative, and not in the job's package")
        return str(path)

    for fields, written in ((INPUT_FIELDS, False), (OUTPUT_FIELDS, True)):
        for section, field in fields:
            values = raw.get(section)
            if not isinstance(values, dict) or field not in values:
                continue
            value, where = values[field], f"{section}.{field}"
            if (section, field) == ("data", "chat_template") and value == "model":
                continue
            if isinstance(value, list):
                values[field] = [resolve(f"{where}[{i}]", v, written) for i, v in enumerate(value)]
            else:
                values[field] = resolve(where, value, written)
    return problems


def fit_to_model(config: JobConfig) -> tuple[JobConfig, list[str]]:
    """`config` held to its model, before a store, Ray or a server exists: a default
    `data.max_length` lowered to the longest request the model's server takes, where that is
    less (a model of 4096 tokens of context takes 4089; one given explicitly is refused
    instead); and what of it the server would refuse or get wrong, one line per field. Only a
    readable config.json is held to here: a missing or broken one is named by the checks that
    need it (the store's manifest, cluster/job_store.py; `run --dry-run`)."""
    try:
        model = model_config(Path(config.model.path))
    except ModelConfigError:
        return config, []
    problems = []
    try:
        resolve_layer_ids(model, config.model.aux_layer_ids)
    except LayerIdsError as exc:
        problems.append(f"model.aux_layer_ids: {exc}")
    except ModelConfigError:
        pass  # no layer count: named with model.path where the capture is sized
    limit = longest_input(config.server, model)
    if isinstance(limit, str):
        return config, [*problems, limit]
    most, why = limit
    if config.data.max_length > most and "max_length" not in config.data.model_fields_set:
        data = config.data.model_copy(update={"max_length": most})
        config = config.model_copy(update={"data": data})
    if config.data.max_length > most:
        problems.append(
            f"data.max_length: {config.data.max_length} tokens is more than the model's server "
            f"takes in one request, {most} ({why}); set it to at most {most}"
        )
    if config.generate is not None and config.generate.max_new_tokens >= most:
        problems.append(
            f"generate.max_new_tokens: {config.generate.max_new_tokens} leaves no room for a "
            f"prompt in the {most} tokens the model's server takes in one request ({why})"
        )
    return config, problems


def parse_config(raw: Any) -> JobConfig:
    if not isinstance(raw, dict):
        raise ConfigError(f"the job config must be a mapping of sections, got {type(raw).__name__}")
    raw = {name: dict(v) if isinstance(v, dict) else v for name, v in raw.items()}  # ours
    if problems := resolve_paths(raw, Path.cwd(), submitted_job()):
        raise ConfigError(
            "relative paths in a job that `ray job submit` started, which runs in Ray's "
            f"temporary copy of its working_dir ({Path.cwd()}):\n  "
            + "\n  ".join(problems)
            + "\ngive absolute paths (the same on every node) or object storage URLs"
        )
    try:
        config = JobConfig.model_validate(raw)
    except ValidationError as exc:
        lines = [
            f"  {'.'.join(map(str, e['loc'])) or '(top level)'}: {e['msg']}" for e in exc.errors()
        ]
        raise ConfigError("invalid job config:\n" + "\n".join(lines)) from None
    config, problems = fit_to_model(config)
    if problems:
        raise ConfigError("invalid job config:\n" + "\n".join(f"  {p}" for p in problems))
    return config


def load_config(path: str | Path | None, overrides: list[str] = ()) -> JobConfig:
    """The YAML file (None: overrides only) with `overrides` applied on top."""
    raw: Any = {}
    if path is not None:
        try:
            raw = yaml.safe_load(Path(path).read_text()) or {}
        except (OSError, yaml.YAMLError) as exc:
            raise ConfigError(f"cannot read job config {path}: {exc}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the job config must be a mapping of sections")
    return parse_config(apply_overrides(raw, list(overrides)))
