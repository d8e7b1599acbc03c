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

# What a layer id means, in words: a dump's meta.json (written by the capture plugin) and the
# store's manifest both carry it, so a reader never has to guess the indexing.
LAYER_CONVENTION = (
    "aux slot j is the residual stream entering decoder layer layer_ids[j], "
    "i.e. HF transformers output_hidden_states[layer_ids[j]]"
)

# Models whose set_eagle3_layers_to_capture takes explicit ids as given unless the first is 1
# (then every id gets +1): SGLang 0.5.23's deepseek_v2.py, which Kimi-K2.5 delegates to. The
# other families (Llama, Qwen, ...) add 1 to every explicit id.
DEEPSEEK_STYLE = {
    "DeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM",
    "KimiK25ForConditionalGeneration",
}


class LayerIdsError(ValueError):
    """Aux layer ids this model cannot capture."""


class ModelConfigError(ValueError):
    """The model's config.json cannot be read, or lacks what capture is sized by."""


def model_config(model_path: Path) -> dict:
    path = Path(model_path) / "config.json"
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise ModelConfigError(f"{path} does not exist") from None
    except (OSError, ValueError) as exc:
        raise ModelConfigError(f"{path} cannot be read: {exc}") from None
    if not isinstance(config, dict):
        raise ModelConfigError(f"{path} is not a JSON object")
    return config


def num_layers_and_hidden(config: dict) -> tuple[int, int]:
    text = config.get("text_config") or config
    missing = [key for key in ("num_hidden_layers", "hidden_size") if key not in text]
    if missing:
        where = "text_config" if "text_config" in config else "config.json"
        raise ModelConfigError(f"the model's {where} has no {' or '.join(missing)}")
    return int(text["num_hidden_layers"]), int(text["hidden_size"])


def resolve_layer_ids(config: dict, requested: list[int] | None) -> list[int]:
    """The HF hidden_states indices SGLang captures for `--return-aux-hidden-state-layer-ids
    requested` (None: its EAGLE-3 default, the layers it serves the drafter with). Raises
    LayerIdsError for ids no decoder layer of this model takes: SGLang 0.5.23 checks only
    `id < num_hidden_layers` before the +1, so Llama's id L-1 passes its startup check and
    fails the server's first forward ("The model captured 4 aux hidden states, but ... names
    5 layers"; DeepSeek's packer: "captured 4 of 5"), and for a default that repeats a layer
    (models of 4 to 6 layers), naming distinct ids that fit."""
    num_layers, _ = num_layers_and_hidden(config)
    deepseek = bool(set(config.get("architectures") or []) & DEEPSEEK_STYLE)
    if requested is None:
        resolved = [2, num_layers // 2, num_layers - 3]
    elif deepseek:
        resolved = [i + 1 for i in requested] if requested and requested[0] == 1 else requested
    else:
        resolved = [i + 1 for i in requested]
    bad = [i for i in resolved if not 0 <= i < num_layers]
    if bad:
        if requested is None:
            asked, rule = "SGLang's EAGLE-3 default", "[2, L//2, L-3]"
        elif deepseek:
            asked, rule = f"{requested}", "DeepSeek-style: as given, each + 1 if the first is 1"
        else:
            asked, rule = f"{requested}", f"Llama-style: each + 1, so ask for 0..{num_layers - 2}"
        raise LayerIdsError(
            f"aux layer ids {asked} resolve to hidden_states indices {resolved} ({rule}); "
            f"{bad} cannot be captured from this {num_layers}-layer model (indices "
            f"0..{num_layers - 1}: the residual stream entering each decoder layer)"
        )
    if len(set(resolved)) < len(resolved):  # the default only: explicit ids are distinct
        raise LayerIdsError(_default_repeats(config, num_layers, resolved))
    return sorted(resolved)


def _default_repeats(config: dict, num_layers: int, resolved: list[int]) -> str:
    """Why SGLang's EAGLE-3 default does not fit this small model (4 to 6 layers), and ids that
    do. SGLang captures a layer once however often it is listed (`if i in layers_to_capture`):
    a repeated one gives the drafter fewer states than its 3."""
    twice = sorted({i for i in resolved if resolved.count(i) > 1})
    deepseek = bool(set(config.get("architectures") or []) & DEEPSEEK_STYLE)
    capturable = range(0 if deepseek else 1, num_layers)  # Llama-style: not the embeddings
    spread = sorted({capturable[k * (len(capturable) - 1) // 2] for k in range(3)})
    return (
        f"null means SGLang's EAGLE-3 default [2, L//2, L-3], for this {num_layers}-layer model "
        f"hidden_states indices {resolved}: it repeats {twice}, so SGLang would return "
        f"{len(set(resolved))} of the drafter's 3 states; name distinct layers, e.g. "
        f"{requested_layer_ids(config, spread)} (indices {spread})"
    )


def requested_layer_ids(config: dict[str, Any], resolved: Sequence[int]) -> list[int]:
    """The `--return-aux-hidden-state-layer-ids` that make SGLang capture the HF indices
    `resolved` (the inverse of hsx_store.layers.resolve_layer_ids). DeepSeek-style models take ids
    as given unless the first is 1: a resolved [1, ...] is asked for with 1 moved last. Llama and
    the rest add 1: ask for each id minus 1 (the embeddings, 0, cannot be asked for)."""
    resolved = sorted(int(i) for i in resolved)
    if set(config.get("architectures") or []) & DEEPSEEK_STYLE:
        requested = resolved[1:] + resolved[:1] if resolved[:1] == [1] else resolved
    else:
        requested = [i - 1 for i in resolved]
    if min(requested, default=0) < 0 or resolve_layer_ids(config, requested) != resolved:
        raise LayerIdsError(
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
