"""The job configuration: one YAML file, validated field by field, with command-line overrides.

    config = load_config("ray_configs/demo_job.yaml", ["store.url=out/x.zarr", "worker.inflight=4"])

Every field has a default except `model.path` and `data.paths`; unknown fields are errors (a
typo must not silently fall back to a default). Errors name the field: `data.max_length: Input
should be greater than or equal to 1`. Relative paths are resolved against the current
directory (the job's working directory under `ray job submit`).
"""

from __future__ import annotations

import datetime
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from store.location import DEFAULT_CLIENT_OPTIONS, DEFAULT_RETRY, is_remote

# Aux layers one capture may hold: EAGLE-3 uses 3, DFlash-style drafters 5 or more (SGLang
# 0.5.23 has set_dflash_layers_to_capture); capture, store, readers and exports are tested
# with 1, 3, 5 and 8 (tests/test_aux_layers.py).
MAX_AUX_LAYERS = 8


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelConfig(_Section):
    path: str  # a local HF model directory, present on every GPU node at the same path
    # Served dtype; the store keeps hidden states in it (bfloat16 bit-exact as uint16 bits).
    dtype: Literal["bfloat16", "float32"] = "bfloat16"
    # --return-aux-hidden-state-layer-ids as SGLang takes them, 1 to MAX_AUX_LAYERS distinct
    # ids (EAGLE-3: 3; DFlash-style drafters: 5 or more); null: SGLang's EAGLE-3 default
    # [2, L//2, L-3]. Whether the model has those layers is checked when it is read
    # (cluster.job_store.manifest_for), before Ray or a server starts.
    aux_layer_ids: list[int] | None = None
    # Run the model's own tokenizer/model code (Kimi-K2.5 needs it); also passed to SGLang.
    trust_remote_code: bool = False

    @field_validator("aux_layer_ids")
    @classmethod
    def _distinct(cls, ids: list[int] | None) -> list[int] | None:
        if ids is None:
            return ids
        if not 1 <= len(ids) <= MAX_AUX_LAYERS:
            raise ValueError(f"must name 1 to {MAX_AUX_LAYERS} layers, got {len(ids)}: {ids}")
        repeated = sorted({i for i in ids if ids.count(i) > 1})
        if repeated:
            raise ValueError(f"layer ids must be distinct, {repeated} repeated in {ids}")
        if min(ids) < 0:
            raise ValueError(f"layer ids must be non-negative, got {ids}")
        return ids


# Set through their fields: the placement of servers on GPUs depends on them.
_PLACEMENT_ARGS = {
    "--tp-size": "tp_size",
    "--tensor-parallel-size": "tp_size",
    "--dp-size": "dp_size",
    "--data-parallel-size": "dp_size",
}


class ServerConfig(_Section):
    # GPUs of one tensor-parallel group; null: the GPUs of a server's share of the node
    # (every GPU with one server per node; 1 on a CPU node).
    tp_size: int | None = Field(None, ge=1)
    # SGLang --dp-size: data-parallel replicas inside one server, each of tp_size GPUs, so a
    # server spans tp_size x dp_size GPUs. DP attention (--attn-dp-size, within the TP group)
    # goes in extra_args.
    dp_size: int = Field(1, ge=1)
    extra_args: list[str] = []  # appended to the SGLang command line
    max_total_tokens: int | None = Field(None, ge=1)  # null: SGLang's sizing (8192 on CPU)
    start_timeout_s: float = Field(900.0, gt=0)
    restarts: int = Field(3, ge=0)  # per worker, each followed by a fresh calibration
    restart_backoff_s: float = Field(5.0, ge=0)
    request_timeout_s: float = Field(900.0, gt=0)

    @field_validator("extra_args")
    @classmethod
    def _no_placement_args(cls, args: list[str]) -> list[str]:
        for arg in args:
            flag = arg.split("=", 1)[0]
            if flag in _PLACEMENT_ARGS:
                raise ValueError(f"{flag}: set server.{_PLACEMENT_ARGS[flag]} instead")
        return args


class DataConfig(_Section):
    paths: list[str] = Field(min_length=1)  # .jsonl / .parquet files, or HF datasets dirs
    format: Literal["auto", "jsonl", "parquet", "hf"] = "auto"  # auto: by suffix / directory
    split: str = "train"  # for a saved DatasetDict
    id_field: str = "id"  # optional per row; else "<file>:<row>"
    text_field: str = "text"  # a row holds either text ...
    messages_field: str = "messages"  # ... or chat messages [{"role", "content"}, ...]
    roles: list[str] = ["system", "user", "assistant", "tool"]  # a message with another: rejected
    # "model": the tokenizer's own chat template; otherwise the path of a Jinja template file.
    chat_template: str = "model"
    # assistant: loss on assistant tokens of chat rows (text rows: every token); all: every token.
    loss_mask: Literal["assistant", "all"] = "assistant"
    max_length: int = Field(4096, ge=1)  # longer prompts are rejected, never truncated


class StoreConfig(_Section):
    url: str  # a local directory, or object storage: s3://bucket/prefix.zarr (gs://, az://)
    # obstore settings for object storage (endpoint, region, client_options, retry_config, ...);
    # credentials are better left to the nodes' AWS_* environment (see ray_configs/README.md).
    storage_options: dict[str, Any] = {}
    codec: Literal["none", "zstd"] = "none"
    codec_level: int = Field(1, ge=1, le=22)
    samples_per_shard: int = Field(64, ge=1)  # one work shard = one lease = one commit
    chunk_tokens: int | None = Field(None, ge=1)  # null: ~32 MB of aux rows per chunk
    # Keep the final norm's input (what vLLM speculators trains on) besides the post-norm state
    # (SpecForge's): one more [T, H] array, +1/(num_aux + 1) of the hidden bytes.
    prenorm: bool = True


class WorkerConfigSection(_Section):
    node_resource: str = "sglang_node"  # the custom resource every GPU node advertises
    inflight: int = Field(8, ge=1)  # requests in flight per server, so SGLang batches them
    sample_attempts: int = Field(3, ge=1)  # then the sample is recorded as failed
    dump_root: str = "/dev/shm"
    log_root: str | None = None  # servers' logs (private, kept if failed); null: temp dir
    max_pending_bytes: int = Field(4 << 30, ge=1 << 20)
    writer_threads: int = Field(2, ge=1)
    heartbeat_s: float = Field(10.0, gt=0)
    # Servers (each with its own worker) per node. null: as many as the node's GPUs hold
    # (GPUs // (tp_size x dp_size)), 1 on a CPU node; a number: exactly that many (on a CPU
    # node too, e.g. for tests), an error for a GPU node too small for them.
    servers_per_node: int | None = Field(None, ge=1)
    # Workers lost in one server slot of a node before that slot is given up (with one server
    # per node: the node).
    max_node_failures: int = Field(3, ge=1)


# obstore's own defaults where store/location.py sets none.
_OBSTORE_DEFAULT_MAX_BACKOFF_S = 15.0
_DURATION_UNITS = {"ms": 1e-3, "s": 1.0, "sec": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0}


def _seconds(value: Any) -> float:
    """An obstore duration (timedelta, seconds, or "60s", "1m 30s", "500ms") in seconds."""
    if isinstance(value, datetime.timedelta):
        return value.total_seconds()
    if isinstance(value, int | float):
        return float(value)
    text = str(value).strip().lower()
    pairs = re.findall(r"(\d+(?:\.\d+)?)\s*([a-z]+)\s*", text)
    if not re.fullmatch(r"(\d+(\.\d+)?\s*[a-z]+\s*)+", text) or any(
        unit not in _DURATION_UNITS for _, unit in pairs
    ):
        raise ValueError(f"cannot read {value!r} as a duration (e.g. 60s, 1m 30s, 500ms)")
    return sum(float(n) * _DURATION_UNITS[unit] for n, unit in pairs)


def store_write_bound_s(storage_options: dict[str, Any]) -> float:
    """The longest one chunk PUT to object storage can go on: its last retry starts by
    retry_timeout + max_backoff and runs at most the client timeout (store/location.py)."""
    client = {**DEFAULT_CLIENT_OPTIONS, **storage_options.get("client_options", {})}
    retry = {**DEFAULT_RETRY, **storage_options.get("retry_config", {})}
    max_backoff = retry.get("backoff", {}).get("max_backoff", _OBSTORE_DEFAULT_MAX_BACKOFF_S)
    return _seconds(retry["retry_timeout"]) + _seconds(max_backoff) + _seconds(client["timeout"])


class QueueConfig(_Section):
    lease_s: float = Field(300.0, gt=0)  # a lease not renewed this long goes back to the queue
    # A holder starts no store write later than lease_s - margin_s after asking for its last
    # renewal, and the queue lets no one else write the shard until margin_s after the lease
    # expired (cluster/shard_queue.py). Must exceed the longest a store write can take. null:
    # that + 15 s on object storage (210 s with store/location.py's defaults); lease_s / 2 on
    # a local store (no client timeout there: a write to a hung mount is not bounded).
    margin_s: float | None = Field(None, gt=0)
    shard_attempts: int = Field(3, ge=1)  # leases of a shard lost to failures before it is failed
    # At the tail (nothing pending) an idle worker re-runs a shard leased longer than
    # straggler_factor x the median shard time (and at least straggler_min_s); first commit wins.
    straggler_factor: float = Field(2.0, ge=1.0)
    straggler_min_s: float = Field(60.0, ge=0)


class DriverConfig(_Section):
    progress_interval_s: float = Field(10.0, gt=0)
    # Once every shard is done, workers still busy after this long (a straggler whose shard a
    # duplicate committed, stuck in a slow request) are stopped rather than waited for.
    finish_grace_s: float = Field(60.0, ge=0)
    # With no usable GPU node at all, wait this long for one to join before giving up.
    node_wait_s: float = Field(300.0, ge=0)
    # Parts of the data planned at once, as Ray tasks on the nodes that hold every input at
    # its path; null: one per CPU of those nodes. The plan is the same whatever the number.
    planners: int | None = Field(None, ge=1)


class JobConfig(_Section):
    model: ModelConfig
    data: DataConfig
    store: StoreConfig
    server: ServerConfig = ServerConfig()
    worker: WorkerConfigSection = WorkerConfigSection()
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


def parse_config(raw: Any) -> JobConfig:
    if not isinstance(raw, dict):
        raise ConfigError(f"the job config must be a mapping of sections, got {type(raw).__name__}")
    try:
        return JobConfig.model_validate(raw)
    except ValidationError as exc:
        lines = [
            f"  {'.'.join(map(str, e['loc'])) or '(top level)'}: {e['msg']}" for e in exc.errors()
        ]
        raise ConfigError("invalid job config:\n" + "\n".join(lines)) from None


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
