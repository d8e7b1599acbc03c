"""EAGLE-3 drafts in vLLM speculators 0.9.0's saved layout (`Eagle3DraftModel.save_pretrained`:
config.json and model.safetensors), written without speculators, and stores to convert them
against, for the draft-convert tests; tests/integration/test_draft_convert.py checks this layout
against speculators' own saves."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file

from hsx_store.builder import create_store
from hsx_store.export.sglang_draft import LAYER_WEIGHTS
from hsx_store.format import Store, make_manifest
from hsx_store.layers import expected_capture

LAYER_KEYS = (
    "attention_bias", "attention_dropout", "bos_token_id", "eos_token_id", "head_dim",
    "hidden_act", "hidden_size", "initializer_range", "intermediate_size",
    "max_position_embeddings", "mlp_bias", "num_attention_heads", "num_key_value_heads",
    "pretraining_tp", "rms_norm_eps", "rope_parameters", "tie_word_embeddings", "use_cache",
    "vocab_size",
)  # fmt: skip


def speculators_draft(
    path: Path,
    target: Path,
    layer_ids: list[int],
    *,
    num_layers: int = 1,
    draft_vocab_size: int | None = None,
    layer: dict[str, Any] | None = None,
    drop: tuple[str, ...] = (),
    extra: tuple[str, ...] = (),
    **flags: Any,
) -> Path:
    """A draft for the model at `target` trained on `layer_ids` (hidden_states indices), as
    speculators' `from_training_args` + `save_pretrained` leave it: its Llama layer config
    shaped after the target's (`layer` overrides fields), the eagle3 flags (`flags`: any of
    norm_before_residual, norm_before_fc, fc_norm, norm_output, embed_requires_grad; False by
    default), random weights; the tensors `drop` left out, `extra` added."""
    source = json.loads((target / "config.json").read_text())
    text = source.get("text_config") or source
    defaults = {"head_dim": text["hidden_size"] // text["num_attention_heads"]}
    tl = {k: text.get(k, defaults.get(k)) for k in LAYER_KEYS}
    tl["rope_parameters"] = text.get("rope_parameters") or {
        "rope_type": "default",
        "rope_theta": 1e4,
    }
    tl.update(
        {
            "model_type": "llama",
            "num_hidden_layers": num_layers,
            "layer_types": ["full_attention"] * num_layers,
            "sliding_window": 2048,
            "use_sliding_window": False,
            "pad_token_id": None,
            "attention_bias": False,
            "mlp_bias": False,
            "hidden_act": "silu",
            **(layer or {}),
        }
    )
    vocab, hidden = int(text["vocab_size"]), int(tl["hidden_size"])
    drafted = draft_vocab_size or vocab
    config = {
        "architectures": ["Eagle3DraftModel"],
        "auto_map": {"": "config.Eagle3SpeculatorConfig"},
        "draft_vocab_size": drafted,
        "dtype": "float32",
        "eagle_aux_hidden_state_layer_ids": layer_ids,
        "embed_requires_grad": False,
        "fc_norm": False,
        "norm_before_fc": False,
        "norm_before_residual": False,
        "norm_output": False,
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [
                {
                    "accept_tolerance": 0.0,
                    "proposal_type": "greedy",
                    "speculative_tokens": 3,
                    "verifier_accept_k": 1,
                }
            ],
            "verifier": {"architectures": source["architectures"], "name_or_path": str(target)},
        },
        "speculators_model_type": "eagle3",
        "speculators_version": "0.9.0",
        "target_hidden_size": None,
        "tie_word_embeddings": False,
        "transformer_layer_config": tl,
        "transformers_version": "5.19.0",
    }
    config.update(flags)
    g = torch.Generator().manual_seed(0)
    shapes = draft_shapes(tl, len(layer_ids), vocab, drafted, config)
    tensors = {n: torch.randn(s, generator=g) for n, s in shapes.items() if n not in drop}
    if drafted < vocab:
        hot = torch.randperm(vocab, generator=g)[:drafted].sort().values
        tensors["d2t"] = hot - torch.arange(drafted)
        tensors["t2d"] = torch.zeros(vocab, dtype=torch.bool).index_fill_(0, hot, True)
    for name in extra:
        tensors[name] = torch.randn(hidden, generator=g)
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return path


def draft_shapes(
    tl: dict[str, Any], num_aux: int, vocab: int, drafted: int, config: dict[str, Any]
) -> dict[str, tuple[int, ...]]:
    """Every float tensor's shape, as speculators' Eagle3DraftModel makes it."""
    hidden, inter = tl["hidden_size"], tl["intermediate_size"]
    q, kv = tl["num_attention_heads"] * tl["head_dim"], tl["num_key_value_heads"] * tl["head_dim"]
    shapes: dict[str, tuple[int, ...]] = {
        "embed_tokens.weight": (vocab, hidden),
        "lm_head.weight": (drafted, hidden),
        "fc.weight": (hidden, num_aux * hidden),
        "norm.weight": (hidden,),
        "layers.0.hidden_norm.weight": (hidden,),
    }
    for k in range(tl["num_hidden_layers"]):
        width = 2 * hidden if k == 0 else hidden  # the first layer takes [embeds, hidden]
        layer = dict(
            zip(
                LAYER_WEIGHTS,
                [(q, width), (kv, width), (kv, width), (hidden, q), (inter, hidden),
                 (inter, hidden), (hidden, inter), (hidden,), (hidden,)],
                strict=True,
            )
        )  # fmt: skip
        shapes |= {f"layers.{k}.{name}": shape for name, shape in layer.items()}
    if config["norm_before_fc"]:
        shapes["input_norm.weight"] = (num_aux * hidden,)
    if config["fc_norm"]:
        shapes |= {f"fc_norm.{i}.weight": (hidden,) for i in range(num_aux)}
    return shapes


def draft_store(
    url: Path, target: Path, requested: list[int], *, model: str | None = None
) -> Store:
    """A store planned for `target`, capturing the layers SGLang gives for the ids `requested`
    (no rows written: draft-convert reads the manifest only). `model`: the manifest's model
    path (default: `target`'s)."""
    capture = expected_capture(target, requested, "float32")
    manifest = make_manifest(
        model or str(target), target, capture, max_length=64, samples_per_shard=2
    )
    ids = [np.arange(5, dtype=np.int32), np.arange(3, dtype=np.int32)]
    return create_store(url, manifest, ["a", "b"], ids, [np.ones(len(i), np.uint8) for i in ids])
