"""Which hidden states SGLang's EAGLE-3 capture returns, predicted before any server starts.

The plan writes the resolved layers into the store's manifest; each worker's calibration then
checks that its server really captures them. Indices are HF `output_hidden_states` indices:
index i is the residual stream entering decoder layer i (0 = the embeddings).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from patches.dump_files import LAYER_CONVENTION

# Models whose set_eagle3_layers_to_capture takes explicit ids as given unless the first is 1
# (then every id gets +1): SGLang 0.5.23's deepseek_v2.py, which Kimi-K2.5 delegates to. The
# other families (Llama, Qwen, ...) add 1 to every explicit id.
DEEPSEEK_STYLE = {
    "DeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM",
    "KimiK25ForConditionalGeneration",
}


def model_config(model_path: Path) -> dict:
    return json.loads((Path(model_path) / "config.json").read_text())


def num_layers_and_hidden(config: dict) -> tuple[int, int]:
    text = config.get("text_config") or config
    return int(text["num_hidden_layers"]), int(text["hidden_size"])


def resolve_layer_ids(config: dict, requested: list[int] | None) -> list[int]:
    """The HF hidden_states indices SGLang captures for `--return-aux-hidden-state-layer-ids
    requested` (None: its EAGLE-3 default, the layers it serves the drafter with)."""
    num_layers, _ = num_layers_and_hidden(config)
    if requested is None:
        resolved = [2, num_layers // 2, num_layers - 3]
    elif set(config.get("architectures") or []) & DEEPSEEK_STYLE:
        resolved = [i + 1 for i in requested] if requested and requested[0] == 1 else requested
    else:
        resolved = [i + 1 for i in requested]
    bad = [i for i in resolved if not 0 <= i < num_layers]
    if bad:
        raise ValueError(
            f"aux layer ids {requested} resolve to hidden_states indices {resolved}; {bad} "
            f"cannot be captured from a {num_layers}-layer model (valid: 0..{num_layers - 1})"
        )
    return sorted(resolved)


def requested_layer_ids(config: dict[str, Any], resolved: Sequence[int]) -> list[int]:
    """The `--return-aux-hidden-state-layer-ids` that make SGLang capture the HF indices
    `resolved` (the inverse of store.layers.resolve_layer_ids). DeepSeek-style models take ids
    as given unless the first is 1: a resolved [1, ...] is asked for with 1 moved last. Llama and
    the rest add 1: ask for each id minus 1 (the embeddings, 0, cannot be asked for)."""
    resolved = sorted(int(i) for i in resolved)
    if set(config.get("architectures") or []) & DEEPSEEK_STYLE:
        requested = resolved[1:] + resolved[:1] if resolved[:1] == [1] else resolved
    else:
        requested = [i - 1 for i in resolved]
    if min(requested, default=0) < 0 or resolve_layer_ids(config, requested) != resolved:
        raise ValueError(
            f"no --return-aux-hidden-state-layer-ids make SGLang capture {resolved} "
            f"for {config.get('architectures')}"
        )
    return requested


def expected_capture(model_path: Path, requested: list[int] | None, dtype: str) -> dict:
    """The capture fields of a dump's meta (and of the store's manifest) that a server of this
    model must produce; calibration compares them key by key."""
    config = model_config(model_path)
    layer_ids = resolve_layer_ids(config, requested)
    return {
        "layer_ids": layer_ids,
        "layer_convention": LAYER_CONVENTION,
        "hidden_size": num_layers_and_hidden(config)[1],
        "num_aux": len(layer_ids),
        "dtype": dtype,
    }
