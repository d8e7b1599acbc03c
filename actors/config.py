"""The sections of the job config a node worker reads (model, store, server, worker).

cluster/config.py adds the rest (data, queue, driver) to make the whole job config; the driver
hands that to every NodeWorker as it is, so there is one description of a worker, here. Each
field's docstring is its documentation (docs/configuration.md is generated from them).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from hsx_store.location import obstore_options

# Aux layers one capture may hold: EAGLE-3 uses 3, DFlash-style drafters 5 or more (SGLang
# 0.5.23 has set_dflash_layers_to_capture); capture, store, readers and exports are tested
# with 1, 3, 5 and 8.
MAX_AUX_LAYERS = 8

# Set through their fields: the placement of servers on GPUs depends on them.
_PLACEMENT_ARGS = {
    "--tp-size": "tp_size",
    "--tensor-parallel-size": "tp_size",
    "--dp-size": "dp_size",
    "--data-parallel-size": "dp_size",
}


class Section(BaseModel):
    """A config section: frozen, unknown fields refused, field docstrings as descriptions."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


class ModelConfig(Section):
    """The target model, served by SGLang on every GPU node."""

    path: str
    """A local HF model directory, at the same path on every GPU node and on the head (the
    driver reads its config.json and tokenizer)."""
    dtype: Literal["bfloat16", "float32"] = "bfloat16"
    """The dtype SGLang serves the model in; the store keeps hidden states in it, bit for bit
    (unless store.dtype is fp8_e4m3)."""
    aux_layer_ids: list[int] | None = None
    """`--return-aux-hidden-state-layer-ids` as SGLang takes them: 1 to 8 distinct ids
    (EAGLE-3: 3; DFlash-style drafters: 5 or more). null: SGLang's EAGLE-3 default
    [2, L//2, L-3] (refused where it repeats a layer: 4 to 6 layers). Ids the model cannot
    capture are refused when its config.json is read, before Ray or a server starts."""
    trust_remote_code: bool = False
    """Run the model's own tokenizer and model code (Kimi-K2.5 needs it); passed to SGLang."""

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


class StoreConfig(Section):
    """Where and how the hidden states are stored (docs/store-format.md)."""

    url: str
    """A local directory, or object storage: `s3://bucket/prefix.zarr` (`gs://`, `az://`)."""
    storage_options: dict[str, Any] = {}
    """obstore settings for object storage (endpoint, region, client_options, retry_config,
    ...); credentials are better left to the nodes' `AWS_*` environment. Durations (timeouts,
    retry_timeout, backoffs) are seconds or text such as "30s", "1m 30s", "500ms"."""
    codec: Literal["none", "zstd"] = "none"
    """Chunk compression. zstd level 1 shrank bf16 activations only 1.21x here and halved the
    write speed."""
    codec_level: int = Field(1, ge=1, le=22)
    """The zstd level (with codec zstd)."""
    samples_per_shard: int = Field(64, ge=1)
    """Samples in one work shard: one lease, one commit."""
    chunk_tokens: int | None = Field(None, ge=1)
    """Token rows per chunk. null: the power of two (256 to 8192) nearest 32 MiB of aux rows
    (1024 for 3 aux layers x 7168 in bf16)."""
    prenorm: bool = True
    """Keep the final norm's input (what vLLM speculators trains on) besides the post-norm
    state (SpecForge's): one more [T, H] array, +1/(num_aux + 1) of the hidden bytes."""
    dtype: Literal["model", "fp8_e4m3"] = "model"
    """"model": the served dtype, bit for bit; "fp8_e4m3": e4m3 with a float32 scale per
    token and layer, ~half of bf16's bytes, read back as bf16 (needs model.dtype bfloat16)."""
    fp8_quantizer: Literal["server", "writer"] = "server"
    """Where an fp8_e4m3 store's rows are quantized. "server": in the capture plugin (on a GPU,
    on the stream that copies them out: half the bytes to copy, hold and write); "writer": the
    worker's shard writer, from bf16 dumps. The stored bytes are the same; a server whose
    plugin dumps bf16 (an older one) gets the writer either way."""

    @field_validator("storage_options")
    @classmethod
    def _obstore_options(cls, options: dict[str, Any]) -> dict[str, Any]:
        obstore_options(options)  # what obstore would refuse later, named now
        return options


class ServerConfig(Section):
    """Each SGLang server a worker starts."""

    tp_size: int | None = Field(None, ge=1)
    """GPUs of one tensor-parallel group; null: the GPUs of a server's share of the node
    (every GPU with one server per node; 1 on a CPU node)."""
    dp_size: int = Field(1, ge=1)
    """SGLang `--dp-size`: data-parallel replicas inside one server, each of tp_size GPUs, so a
    server spans tp_size x dp_size GPUs. DP attention (`--attn-dp-size`, within the TP group)
    goes in extra_args."""
    extra_args: list[str] = []
    """Appended to the SGLang command line."""
    max_total_tokens: int | None = Field(None, ge=1)
    """The server's KV cache in tokens; null: SGLang's sizing on GPU, 8192 on CPU."""
    start_timeout_s: float = Field(900.0, gt=0)
    """How long a server may take to become healthy."""
    restarts: int = Field(3, ge=0)
    """Restarts per worker of a server that died, each followed by a fresh calibration."""
    restart_backoff_s: float = Field(5.0, ge=0)
    """Wait before the n-th restart: n times this."""
    request_timeout_s: float = Field(900.0, gt=0)
    """One prefill request's timeout."""

    @field_validator("extra_args")
    @classmethod
    def _no_placement_args(cls, args: list[str]) -> list[str]:
        for arg in args:
            flag = arg.split("=", 1)[0]
            if flag in _PLACEMENT_ARGS:
                raise ValueError(f"{flag}: set server.{_PLACEMENT_ARGS[flag]} instead")
        return args


class WorkerConfig(Section):
    """Each node worker (one per server) and its placement."""

    node_resource: str = "sglang_node"
    """The custom Ray resource every GPU node advertises."""
    servers_per_node: int | None = Field(None, ge=1)
    """Servers (each with its own worker) per node. null: as many as the node's GPUs hold
    (GPUs // (tp_size x dp_size)), 1 on a CPU node; a number: exactly that many (on a CPU node
    too, e.g. for tests), an error for a GPU node too small for them."""
    max_node_failures: int = Field(3, ge=1)
    """Workers lost in one server slot of a node before that slot is given up (with one server
    per node: the node)."""
    inflight: int = Field(8, ge=1)
    """Requests in flight per server, so SGLang batches them."""
    sample_attempts: int = Field(3, ge=1)
    """Attempts at a sample whose dump fails its checks; then it is recorded as failed."""
    dump_root: str = "/dev/shm"
    """Where the servers' dumps are published: a tmpfs (RAM) on GPU nodes; size it as
    ray_configs/README.md says."""
    log_root: str | None = None
    """Where the servers' logs go (private, kept if the worker failed); null: the temp dir."""
    log_retention_s: float = Field(3 * 24 * 3600, ge=0)
    """How long the log of a worker that failed or was killed stays on its node; the next worker
    there removes older ones (and, at once, every dump a dead worker left)."""
    max_pending_bytes: int = Field(4 << 30, ge=1 << 20)
    """Captured bytes a server may hold unpublished before its forward waits (per DP rank;
    back-pressure, never a dropped capture)."""
    writer_threads: int = Field(2, ge=1)
    """Threads writing a shard's chunks to the store."""
    heartbeat_s: float = Field(10.0, gt=0)
    """How often a worker renews its lease; at most a third of queue.lease_s - the margin."""
    idle_poll_s: float = Field(1.0, gt=0)
    """With nothing to lease, ask again after this (backing off to 4x)."""


class GenerateConfig(Section):
    """The target model writes the responses before they are captured (docs/design/generation.md):
    the server writes each prompt's assistant turns anew, `n` times; a sample is the prompt's
    tokens with the generated ones as the server returned them."""

    turns: Literal["last", "all"] = "last"
    """last: the last assistant turn is written anew (a conversation that ends with another
    role gets one); all: every assistant turn, in order, each fed into the next (the tokens the
    model wrote, as it would see them in a running conversation)."""
    n: int = Field(1, ge=1)
    """Responses per prompt, each a sample of its own (ids `<prompt id>#<k>` when n > 1)."""
    max_new_tokens: int = Field(512, ge=1)
    """The longest response; a prompt with no room for it under data.max_length is rejected."""
    temperature: float = Field(0.0, ge=0)
    """0: greedy."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling: the smallest set of tokens holding this much probability."""
    top_k: int = Field(-1, ge=-1)
    """Sample among the k most likely tokens; -1: no limit."""
    min_p: float = Field(0.0, ge=0, le=1)
    """Leave out tokens less likely than this x the most likely one's probability."""
    stop: list[str] = []
    """Strings that end a response (besides the model's own end-of-turn tokens); an empty one,
    which every text holds, is refused."""
    seed: int = 0
    """The job's seed: each response's seed derives from it and its sample id. SGLang samples
    with it only on a server run with --enable-deterministic-inference (server.extra_args; GPU
    attention backends only); greedy jobs need none."""
    on_length: Literal["keep", "reject"] = "keep"
    """A response cut at max_new_tokens: kept (its finish reason says length, and no end-of-turn
    follows it) or rejected with the reason."""
    inflight: int | None = Field(None, ge=1)
    """Generation requests in flight per server; null: worker.inflight x 4 (decode batches)."""

    @field_validator("stop")
    @classmethod
    def _no_empty_stop(cls, stop: list[str]) -> list[str]:
        # SGLang ends a response at the first stop string its text holds: "" after one token.
        if "" in stop:
            raise ValueError(f"entry {stop.index('')} is empty, which ends every response at once")
        return stop

    def sampling_params(self) -> dict[str, Any]:
        """SGLang's sampling parameters for one response (the seed is per response)."""
        return {
            "max_new_tokens": self.max_new_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "stop": list(self.stop),
        }


class WorkerJobConfig(Section):
    """What a node worker needs of the job: the model, the store, its server and itself."""

    model: ModelConfig
    store: StoreConfig
    server: ServerConfig = ServerConfig()
    worker: WorkerConfig = WorkerConfig()
    generate: GenerateConfig | None = None
    """Generate the responses with the target model before capturing them; absent: the input
    rows are captured as they are."""

    def server_args(self) -> list[str]:
        """SGLang flags from the model section, then server.extra_args."""
        trust = ["--trust-remote-code"] if self.model.trust_remote_code else []
        return ["--dtype", self.model.dtype, *trust, *self.server.extra_args]
