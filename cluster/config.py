"""The job configuration: one YAML file, validated field by field, with command-line overrides.

    config = load_config("ray_configs/demo_job.yaml", ["store.url=out/x.zarr", "worker.inflight=4"])

Every field has a default except `model.path` and `data.paths`; unknown fields are errors (a
typo must not silently fall back to a default). Errors name the field: `data.max_length: Input
should be greater than or equal to 1`. Relative paths are resolved against the current
directory (the job's working directory under `ray job submit`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelConfig(_Section):
    path: str  # a local HF model directory, present on every GPU node at the same path
    # Served dtype; the store keeps hidden states in it (bfloat16 bit-exact as uint16 bits).
    dtype: Literal["bfloat16", "float32"] = "bfloat16"
    # --return-aux-hidden-state-layer-ids as SGLang takes them; null: SGLang's EAGLE-3 default.
    aux_layer_ids: list[int] | None = None
    # Run the model's own tokenizer/model code (Kimi-K2.5 needs it); also passed to SGLang.
    trust_remote_code: bool = False

    @field_validator("aux_layer_ids")
    @classmethod
    def _distinct(cls, ids: list[int] | None) -> list[int] | None:
        if ids is not None and (not ids or len(set(ids)) != len(ids) or min(ids) < 0):
            raise ValueError("must be a non-empty list of distinct, non-negative layer ids")
        return ids


class ServerConfig(_Section):
    tp_size: int | None = Field(None, ge=1)  # null: every GPU of the node (1 on a CPU node)
    extra_args: list[str] = []  # appended to the SGLang command line
    max_total_tokens: int | None = Field(None, ge=1)  # null: SGLang's sizing (8192 on CPU)
    start_timeout_s: float = Field(900.0, gt=0)
    restarts: int = Field(3, ge=0)  # per worker, each followed by a fresh calibration
    restart_backoff_s: float = Field(5.0, ge=0)
    request_timeout_s: float = Field(900.0, gt=0)


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


class WorkerConfigSection(_Section):
    node_resource: str = "sglang_node"  # the custom resource every GPU node advertises
    inflight: int = Field(8, ge=1)  # requests in flight per server, so SGLang batches them
    sample_attempts: int = Field(3, ge=1)  # then the sample is recorded as failed
    dump_root: str = "/dev/shm"
    log_root: str | None = None  # servers' logs (private, kept if failed); null: temp dir
    max_pending_bytes: int = Field(4 << 30, ge=1 << 20)
    writer_threads: int = Field(2, ge=1)
    heartbeat_s: float = Field(10.0, gt=0)
    max_node_failures: int = Field(3, ge=1)  # workers lost on one node before it is given up


class QueueConfig(_Section):
    lease_s: float = Field(120.0, gt=0)  # a lease not renewed this long goes back to the queue
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


class JobConfig(_Section):
    model: ModelConfig
    data: DataConfig
    store: StoreConfig
    server: ServerConfig = ServerConfig()
    worker: WorkerConfigSection = WorkerConfigSection()
    queue: QueueConfig = QueueConfig()
    driver: DriverConfig = DriverConfig()


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
