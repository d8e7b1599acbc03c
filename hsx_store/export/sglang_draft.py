"""A draft vLLM speculators 0.9.0 trained on a store's data (`Eagle3DraftModel.save_pretrained`),
made into the EAGLE-3 draft SGLang 0.5.23 serves (`LlamaForCausalLMEagle3`): DIR/config.json
and DIR/model.safetensors (`python -m cluster draft-convert`; the forwards compared, field by
field: docs/using-the-data.md#serving-the-draft-with-sglang).

The store's manifest is the one source of truth for the layers: the draft's
`eagle_aux_hidden_state_layer_ids` are the ids that make SGLang capture the manifest's layers
from the target (`hsx_store.layers.requested_layer_ids`: Llama-family targets add 1 to each id,
DeepSeek-style ones take them as given unless the first is 1), so the target model's config is
read (its identity checked against the manifest's). A draft SGLang would run with another
forward than the one speculators trained is refused (`DraftRefused`), each reason naming how
to train one it runs as trained; inputs that cannot be used raise `DraftInputError`.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from zarr.errors import GroupNotFoundError

from hsx_store.export.files import write_atomic
from hsx_store.format import Manifest, Store, StoreFormatError
from hsx_store.layers import (
    DEEPSEEK_STYLE,
    LayerIdsError,
    ModelConfigError,
    model_config,
    requested_layer_ids,
    resolve_layer_ids,
)
from hsx_store.lm_head import tensor_files
from hsx_store.location import StoreAccessError
from hsx_store.model_identity import WEIGHT_SUFFIXES, model_mismatches

ARCHITECTURE = "LlamaForCausalLMEagle3"
LAYER_SHIFT_FLAG = "--layer-shift"
# speculators' flags SGLang runs as trained, and where its llama_eagle3.py reads each: the
# eagle_config's key first, then the config's (norm_before_fc), the config's only (the others).
MAPPED_FLAGS = {"norm_before_fc": "eagle_config", "fc_norm": "config", "norm_output": "config"}
# RoPE types whose SGLang rotary (get_rope) equals transformers' (what speculators' draft layer
# uses), with the parameters each may set; others (dynamic, longrope, ...) compute other angles.
ROPE_PARAMETERS = {
    "default": {"rope_theta"},
    "linear": {"rope_theta", "factor"},
    "llama3": {
        "rope_theta",
        "factor",
        "low_freq_factor",
        "high_freq_factor",
        "original_max_position_embeddings",
    },
    "yarn": {
        "rope_theta",
        "factor",
        "original_max_position_embeddings",
        "beta_fast",
        "beta_slow",
        "mscale",
        "mscale_all_dim",
        "truncate",
    },  # not attention_factor: SGLang's yarn has none
}
LAYER_WEIGHTS = (
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
)


class DraftRefused(ValueError):
    """A draft SGLang would serve with another forward than speculators trained, or one made
    for other data than the store's."""


class DraftInputError(ValueError):
    """An input that cannot be used: the draft's files, the target model, the --layer-shift, the
    output directory."""


def convert_draft(
    draft_dir: str | Path,
    url: str,
    out: str | Path,
    *,
    model_dir: str | Path | None = None,
    layer_shift: int = 0,
    storage_options: Mapping[str, Any] | None = None,
    say: Callable[[str], Any] = print,
) -> dict[str, Any]:
    """Write SGLang's draft of the speculators draft at `draft_dir` into `out`, for the target
    that made the store at `url` (its directory: `model_dir`, else the manifest's `model`).
    `layer_shift`: a diagnostic, every aux id shifted by it (the draft then reads other layers
    than it was trained on). Returns the written config."""
    draft_dir, out = Path(draft_dir), Path(out)
    draft, tensors = read_draft(draft_dir)
    try:
        store = Store.open(url, storage_options=storage_options)
    except (FileNotFoundError, GroupNotFoundError):
        raise StoreAccessError(f"{url}: no store there") from None
    manifest = store.manifest
    target_dir, target = target_model(manifest, model_dir)
    layer = read_layer_config(draft_dir, draft)
    if reasons := refusals(draft, layer, tensors, manifest, target):
        listed = "".join(f"\n  - {reason}" for reason in reasons)
        raise DraftRefused(
            f"{draft_dir}: SGLang's {ARCHITECTURE} would not run this draft as speculators "
            f"trained it:{listed}"
        )
    ids, served = served_layers(target, manifest, layer_shift)
    config = sglang_config(draft, layer, manifest, target, ids)
    config["hsx_draft_convert"] = {
        "draft": str(draft_dir.resolve()),
        "store": str(url),
        "store_id": store.group.attrs.get("store_id"),
        "store_layer_ids": manifest.layer_ids,
        "served_layer_ids": served,
        "layer_shift": layer_shift,
    }
    renamed = sglang_tensors(tensors)
    write_draft(out, config, renamed)
    family = "DeepSeek-style" if _deepseek(target) else "Llama-family"
    say(
        f"draft-convert: {draft_dir} -> {out} ({ARCHITECTURE}, {config['num_hidden_layers']} "
        f"layer(s), draft vocab {config['draft_vocab_size']} of {config['vocab_size']})"
    )
    say(
        f"  eagle_aux_hidden_state_layer_ids {ids}: the {family} target {target_dir} captures "
        f"hidden_states {served} for them; the store holds {manifest.layer_ids}"
    )
    if layer_shift:
        say(
            f"  {LAYER_SHIFT_FLAG} {layer_shift}: a diagnostic: the draft is served layers it "
            f"was not trained on ({served}, not {manifest.layer_ids}): acceptance should drop"
        )
    say(
        f"  serve: --speculative-algorithm EAGLE3 --speculative-draft-model-path {out} "
        f"(--dtype {manifest.served_dtype}, as the store was captured)"
    )
    return config


def read_draft(draft_dir: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The speculators config.json and every tensor of the draft's safetensors files."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        config = model_config(draft_dir)
    except ModelConfigError as exc:
        raise DraftInputError(f"{exc}: not a saved speculators draft") from None
    try:
        files = sorted(set(tensor_files(draft_dir).values()))
        tensors = {k: v for f in files for k, v in load_file(f).items()}
    except (OSError, ValueError, KeyError, SafetensorError) as exc:
        raise DraftInputError(f"{draft_dir}: its safetensors cannot be read: {exc}") from None
    if not tensors:
        raise DraftInputError(f"{draft_dir}: no *.safetensors weights")
    return config, tensors


def read_layer_config(draft_dir: Path, draft: Mapping[str, Any]) -> Any:
    """The draft's decoder-layer config as speculators builds it (its
    `validate_transformer_config`: the model type's transformers config class, defaults filled
    in), for a Llama layer; None for another kind of draft (refused, with the reason)."""
    layer = draft.get("transformer_layer_config")
    if not isinstance(layer, dict) or layer.get("model_type") != "llama":
        return None
    from transformers import LlamaConfig

    try:
        return LlamaConfig(**layer)
    except (TypeError, ValueError) as exc:
        raise DraftInputError(f"{draft_dir}/config.json: transformer_layer_config: {exc}") from None


def target_model(manifest: Manifest, model_dir: str | Path | None) -> tuple[Path, dict]:
    """The target's directory and config.json: `model_dir`, else the manifest's `model` where
    it is a directory here; refused unless it is the model that made the store."""
    path = Path(model_dir if model_dir is not None else manifest.model)
    if model_dir is None and not path.is_dir():
        raise DraftInputError(
            f"the store's model {manifest.model!r} is not a directory here: pass --model with "
            "the target model's directory"
        )
    try:
        config = model_config(path)
    except ModelConfigError as exc:
        raise DraftInputError(str(exc)) from None
    if problems := model_mismatches(path, manifest):
        raise DraftInputError(f"{'; '.join(problems)}: not the model that made the store")
    return path, config


def refusals(
    draft: Mapping[str, Any],
    layer: Any,
    tensors: Mapping[str, torch.Tensor],
    manifest: Manifest,
    target: Mapping[str, Any],
) -> list[str]:
    """Every reason SGLang would serve this draft with another forward than speculators
    trained, or it does not fit the store and its target; empty when it converts."""
    kind = draft.get("speculators_model_type")
    if kind != "eagle3":
        return [f"speculators_model_type is {kind!r}: SGLang's {ARCHITECTURE} serves eagle3"]
    if layer is None:
        found = (draft.get("transformer_layer_config") or {}).get("model_type")
        return [
            f"the draft's decoder layer is {found!r}: SGLang's {ARCHITECTURE} runs a Llama "
            "layer (a qwen3 layer has q_norm/k_norm it lacks); train with --draft-arch llama"
        ]
    return [
        *_forward_refusals(draft, layer),
        *_store_refusals(draft, layer, tensors, manifest, target),
        *_vocab_refusals(draft, tensors, target),
        *_tensor_refusals(draft, layer, tensors, manifest),
    ]


def _forward_refusals(draft: Mapping[str, Any], layer: Any) -> list[str]:
    """Where SGLang's draft forward differs from speculators' for this config."""
    reasons = []
    if draft.get("norm_before_residual", False):
        reasons.append(
            "norm_before_residual is true: speculators' first layer then adds the attention "
            "output to hidden_norm(fc(aux)), SGLang's to fc(aux) un-normed; train with "
            "norm_before_residual=False (`speculators train --no-norm-before-residual`, or "
            "Eagle3DraftModel.from_training_args(norm_before_residual=False, ...))"
        )
    if draft.get("embed_requires_grad", False):
        reasons.append(
            "embed_requires_grad is true: the draft trained its own embeddings, and SGLang "
            "replaces them with the target's (set_embed); train with embed_requires_grad=False"
        )
    types = getattr(layer, "layer_types", None) or []
    sliding = [i for i, t in enumerate(types) if t != "full_attention"]
    if sliding:
        reasons.append(
            f"draft layers {sliding} use {types[sliding[0]]} (window "
            f"{getattr(layer, 'sliding_window', None)}): SGLang's {ARCHITECTURE} attends to the "
            "whole context unless the server is started with --speculative-draft-window-size, "
            "which a config cannot carry; train with full attention "
            "(--full-attention-indices 0 ... L-1)"
        )
    if layer.attention_bias or layer.mlp_bias:
        reasons.append(
            "attention_bias / mlp_bias: SGLang's draft layer has no q/k/v or MLP biases (its "
            "loader would drop them)"
        )
    if layer.hidden_act != "silu":
        reasons.append(f"hidden_act {layer.hidden_act!r}: SGLang's LlamaMLP runs silu only")
    if getattr(layer, "partial_rotary_factor", 1.0) != 1.0:
        reasons.append("partial_rotary_factor != 1: transformers' Llama rotary ignores it")
    rope = dict(layer.rope_parameters or {})
    kind = rope.get("rope_type", "default")
    extra = set(rope) - {"rope_type"} - ROPE_PARAMETERS.get(kind, set())
    if kind not in ROPE_PARAMETERS or extra:
        reasons.append(
            f"rope_parameters {rope}: SGLang's rotary equals transformers' for "
            f"{', '.join(f'{k} {sorted(v)}' for k, v in ROPE_PARAMETERS.items())} only"
        )
    return reasons


def _store_refusals(
    draft: Mapping[str, Any],
    layer: Any,
    tensors: Mapping[str, torch.Tensor],
    manifest: Manifest,
    target: Mapping[str, Any],
) -> list[str]:
    """Where the draft was made for other data than the store holds."""
    reasons = []
    text = target.get("text_config") or target
    ids = draft.get("eagle_aux_hidden_state_layer_ids")
    if ids is None:  # speculators' default (models/utils.py resolve_target_layer_ids)
        num_layers = int(text["num_hidden_layers"])
        ids = [2, num_layers // 2, num_layers - 3]
    if sorted(ids) != manifest.layer_ids:
        reasons.append(
            f"eagle_aux_hidden_state_layer_ids {ids} (hidden_states indices) are not the "
            f"store's layers {manifest.layer_ids}: train with --target-layer-ids "
            f"{' '.join(map(str, manifest.layer_ids))}"
        )
    hidden = manifest.hidden_size
    if layer.hidden_size != hidden or draft.get("target_hidden_size") not in (None, hidden):
        reasons.append(
            f"hidden size {layer.hidden_size} (target_hidden_size "
            f"{draft.get('target_hidden_size')}): the store's states are {hidden} wide"
        )
    fc = tensors.get("fc.weight")
    if fc is not None and tuple(fc.shape) != (layer.hidden_size, manifest.num_aux * hidden):
        reasons.append(
            f"fc.weight is {list(fc.shape)}: {manifest.num_aux} aux states of {hidden} need "
            f"[{layer.hidden_size}, {manifest.num_aux * hidden}]"
        )
    verifier = (draft.get("speculators_config") or {}).get("verifier") or {}
    want = verifier.get("architectures")
    if want and want != target.get("architectures"):
        reasons.append(
            f"trained for a verifier of architectures {want}, the store's model is "
            f"{target.get('architectures')}"
        )
    return reasons


def _vocab_refusals(
    draft: Mapping[str, Any], tensors: Mapping[str, torch.Tensor], target: Mapping[str, Any]
) -> list[str]:
    """The draft's vocabulary against the target's: SGLang maps a draft token to the target's
    as `d2t[i] + i` (its hot_token_id), as speculators does."""
    text = target.get("text_config") or target
    vocab, drafted = int(text["vocab_size"]), int(draft.get("draft_vocab_size") or 0)
    embed, head, d2t = (tensors.get(n) for n in ("embed_tokens.weight", "lm_head.weight", "d2t"))
    reasons = []
    if embed is not None and embed.shape[0] != vocab:
        reasons.append(f"embed_tokens.weight has {embed.shape[0]} rows, the target {vocab} tokens")
    if head is not None and head.shape[0] != drafted:
        reasons.append(f"lm_head.weight has {head.shape[0]} rows, draft_vocab_size {drafted}")
    if not 0 < drafted <= vocab:
        reasons.append(f"draft_vocab_size {drafted}: the target has {vocab} tokens")
    elif drafted < vocab and d2t is None:
        reasons.append(f"draft_vocab_size {drafted} < {vocab} but no d2t maps its tokens")
    elif d2t is not None:
        hot = d2t.to(torch.int64) + torch.arange(len(d2t))
        if (
            len(d2t) != drafted
            or hot.min() < 0
            or hot.max() >= vocab
            or len(hot.unique()) < len(hot)
        ):
            reasons.append(
                f"d2t ({len(d2t)} entries) does not map the {drafted} draft tokens to distinct "
                f"target tokens in 0..{vocab - 1}"
            )
    return reasons


def expected_tensors(draft: Mapping[str, Any], layer: Any, num_aux: int) -> set[str]:
    """The tensors a speculators eagle3 draft of this config saves (embed_tokens, d2t and t2d
    may be absent)."""
    names = {"fc.weight", "norm.weight", "lm_head.weight", "layers.0.hidden_norm.weight"}
    for k in range(layer.num_hidden_layers):
        names |= {f"layers.{k}.{w}" for w in LAYER_WEIGHTS}
    if draft.get("norm_before_fc"):
        names.add("input_norm.weight")
    if draft.get("fc_norm"):
        names |= {f"fc_norm.{i}.weight" for i in range(num_aux)}
    return names


def _tensor_refusals(
    draft: Mapping[str, Any], layer: Any, tensors: Mapping[str, torch.Tensor], manifest: Manifest
) -> list[str]:
    """SGLang's load_weights skips a name it has no parameter for, and leaves a parameter no
    tensor names at its initial value: both silently."""
    expected = expected_tensors(draft, layer, manifest.num_aux)
    optional = {"embed_tokens.weight", "d2t", "t2d"}
    missing, unknown = expected - set(tensors), set(tensors) - expected - optional
    reasons = []
    if missing:
        reasons.append(
            f"tensors missing (SGLang would serve their initial values): {sorted(missing)}"
        )
    if unknown:
        reasons.append(f"tensors SGLang has no parameter for (dropped): {sorted(unknown)}")
    return reasons


def served_layers(
    target: Mapping[str, Any], manifest: Manifest, shift: int
) -> tuple[list[int], list[int]]:
    """The draft config's aux ids (those that make SGLang capture the store's layers, each
    shifted by `shift`) and the hidden_states indices SGLang then captures."""
    try:
        ids = [i + shift for i in requested_layer_ids(target, manifest.layer_ids)]
        return ids, resolve_layer_ids(target, ids)
    except LayerIdsError as exc:
        raise DraftInputError(f"{LAYER_SHIFT_FLAG} {shift}: {exc}" if shift else str(exc)) from None


def sglang_config(
    draft: Mapping[str, Any],
    layer: Any,
    manifest: Manifest,
    target: Mapping[str, Any],
    ids: list[int],
) -> dict[str, Any]:
    """SGLang's LlamaForCausalLMEagle3 config: the draft layer's shape and RoPE, the target's
    vocabulary, the draft's, the ids to capture, the mapped flags where SGLang reads them."""
    text = target.get("text_config") or target
    flags = {name: bool(draft.get(name, False)) for name in MAPPED_FLAGS}
    config = {
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        "hidden_size": layer.hidden_size,
        "intermediate_size": layer.intermediate_size,
        "num_hidden_layers": layer.num_hidden_layers,
        "num_attention_heads": layer.num_attention_heads,
        "num_key_value_heads": layer.num_key_value_heads,
        "head_dim": layer.head_dim,
        "hidden_act": layer.hidden_act,
        "rms_norm_eps": layer.rms_norm_eps,
        "max_position_embeddings": layer.max_position_embeddings,
        "rope_parameters": dict(layer.rope_parameters),
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "vocab_size": int(text["vocab_size"]),
        "draft_vocab_size": int(draft["draft_vocab_size"]),
        "target_hidden_size": manifest.hidden_size,
        "dtype": manifest.served_dtype,
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": ids,
            "use_aux_hidden_state": True,
        },
    }
    for name, where in MAPPED_FLAGS.items():
        (config["eagle_config"] if where == "eagle_config" else config)[name] = flags[name]
    return config


def sglang_tensors(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The draft's tensors under the names SGLang loads: as they are, but for layers after the
    first, whose input norm SGLang's draft layer calls `hidden_norm` (its `input_layernorm` is
    unused there)."""
    renamed = {}
    for name, tensor in tensors.items():
        parts = name.split(".")
        if parts[0] == "layers" and parts[1] != "0" and parts[2:] == ["input_layernorm", "weight"]:
            name = f"layers.{parts[1]}.hidden_norm.weight"
        renamed[name] = tensor.contiguous()
    return renamed


def write_draft(out: Path, config: Mapping[str, Any], tensors: Mapping[str, torch.Tensor]) -> None:
    """model.safetensors, then config.json, each written whole or not at all (over a previous
    conversion's). Refused where `out` holds other weights: SGLang would load those too."""
    from safetensors.torch import save

    others = sorted(
        p.name
        for p in (out.iterdir() if out.is_dir() else ())
        if p.name != "model.safetensors"
        and (p.suffix in WEIGHT_SUFFIXES or p.name.endswith(".index.json"))
    )
    if others:
        raise DraftInputError(f"{out} holds other weights, which SGLang would load too: {others}")
    try:
        out.mkdir(parents=True, exist_ok=True)
        blob = save(dict(tensors), metadata={"format": "pt"})
        write_atomic(out / "model.safetensors", lambda f: f.write(blob))
        text = json.dumps(config, indent=2) + "\n"
        write_atomic(out / "config.json", lambda f: f.write(text.encode()))
    except OSError as exc:
        raise DraftInputError(f"{out}: cannot write the draft: {exc}") from None


def _deepseek(target: Mapping[str, Any]) -> bool:
    return bool(set(target.get("architectures") or []) & DEEPSEEK_STYLE)


def draft_convert_command(
    draft: str, url: str, out: str, *, model: str | None, layer_shift: int
) -> int:
    """Exit 0: converted; 1: the draft refused (the reasons printed); 2: the store cannot be
    read, or an input cannot be used (named)."""
    try:
        convert_draft(
            draft,
            url,
            out,
            model_dir=model,
            layer_shift=layer_shift,
            say=lambda text: print(text, flush=True),
        )
    except DraftRefused as exc:
        print(f"refused: {exc}", file=sys.stderr, flush=True)
        return 1
    except (DraftInputError, StoreFormatError, StoreAccessError) as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
    return 0
