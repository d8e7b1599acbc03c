"""What a model's SGLang server takes, read from its config.json before a store, Ray or a server
exists: its context length as SGLang derives it, and the longest request its server takes.

    longest_input(config.server, model_config(path))   # (4089, "context length 4096, ...")

The job config is held to these when it is read (cluster/config.py `fit_to_model`).
"""

from __future__ import annotations

import os
from typing import Any

from actors.config import ServerConfig

# SGLang 0.5.23 takes an input of at most context_length - 7 tokens: its scheduler refuses
# len >= max_req_input_len = min(context_length, KV pool) - 1 - 5 (managers/tp_worker.py,
# managers/utils.py validate_input_length). Measured: with --context-length 64, an input of 57
# tokens is answered and one of 58 gets HTTP 400.
SGLANG_INPUT_MARGIN = 7

# Where SGLang reads a model's context length (utils/hf_transformers/common.py): the keys in
# its order of preference, in the text config of a multimodal model (get_hf_text_config),
# else 2048.
CONTEXT_LENGTH_KEYS = (
    "max_sequence_length",
    "seq_length",
    "max_seq_len",
    "model_max_length",
    "max_position_embeddings",
)
TEXT_CONFIG_KEYS = ("llm_config", "language_config", "text_config")
SGLANG_DEFAULT_CONTEXT = 2048
# SGLang refuses to start with a --context-length above the model's own unless this is set
# (configs/model_config.py); the driver can only see its own environment, the nodes' as set alike.
SGLANG_LONGER_CONTEXT_ENV = "SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN"


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The part of config.json that describes the language model, as SGLang picks it."""
    thinker = config.get("thinker_config")
    if isinstance(thinker, dict):
        inner = thinker.get("text_config")
        return inner if isinstance(inner, dict) else thinker
    for key in TEXT_CONFIG_KEYS:
        if isinstance(config.get(key), dict):
            return config[key]
    return config


def context_length(config: dict[str, Any]) -> tuple[int, str]:
    """SGLang's context length for a model's config.json (get_context_length), and where it
    comes from. A RoPE scaling factor multiplies it, except where the config keeps the original
    length (YaRN, with original_max_position_embeddings) or the type is llama3."""
    text = text_config(config)
    rope = text.get("rope_scaling") or text.get("rope_parameters")
    rope = rope if isinstance(rope, dict) else {}
    kind = rope.get("rope_type", rope.get("type"))
    unscaled = "original_max_position_embeddings" in rope or kind == "llama3"
    factor = rope["factor"] if _is_number(rope.get("factor")) and not unscaled else 1
    for key in CONTEXT_LENGTH_KEYS:
        value = text.get(key)
        if _is_number(value):
            scaled = f" x rope factor {factor:g}" if factor != 1 else ""
            return int(factor * value), f"config.json {key}{scaled}"
    return SGLANG_DEFAULT_CONTEXT, f"SGLang's default: config.json has no {CONTEXT_LENGTH_KEYS}"


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def flag_value(args: list[str], flag: str) -> str | None:
    """The value a command line gives `flag` (`--flag V` or `--flag=V`; the last one wins, as
    argparse takes it); None: not given."""
    value = None
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
    return value


def longest_input(server: ServerConfig, model: dict[str, Any]) -> tuple[int, str] | str:
    """The most tokens one request to the job's servers may hold, and why; or the problem."""
    context, source = context_length(model)
    given = flag_value(server.extra_args, "--context-length")
    if given is not None:
        if not given.isdigit():
            return f"server.extra_args: --context-length {given!r} is not a number of tokens"
        if int(given) > context and not os.environ.get(SGLANG_LONGER_CONTEXT_ENV):
            return (
                f"server.extra_args: --context-length {given} is more than the model's "
                f"{context} ({source}): SGLang refuses to start so unless "
                f"{SGLANG_LONGER_CONTEXT_ENV}=1 is set (on the nodes and for the driver)"
            )
        context, source = int(given), "--context-length in server.extra_args"
    limits = [(context, f"context length {context}, {source}")]
    if server.max_total_tokens is not None:
        total = server.max_total_tokens
        limits.append((total, f"KV cache of server.max_total_tokens {total}"))
    size, why = min(limits)
    return size - SGLANG_INPUT_MARGIN, f"{why}, less the {SGLANG_INPUT_MARGIN} SGLang keeps"
