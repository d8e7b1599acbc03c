"""A model's output head (`lm_head`), read alone from its safetensors checkpoint.

`verify --logprobs` needs the head's weight and nothing else of the model: Kimi-K2.5's is
163840 x 7168 (~2.3 GB in bf16) in a checkpoint of ~600 GB. The tensor is found through
`model.safetensors.index.json`'s `weight_map` when the checkpoint has one, else by reading the
header of every `*.safetensors` file at the top of the model directory (headers only), and then
loaded alone (`safe_open(...).get_tensor`). Names differ by model:

- `lm_head.weight` (Llama, DeepSeek-V3, most causal LMs);
- `language_model.lm_head.weight` (multimodal wrappers such as Kimi-K2.5);
- with `tie_word_embeddings` in the (text) config, the input embeddings:
  `model.embed_tokens.weight`, `language_model.model.embed_tokens.weight` or
  `model.language_model.embed_tokens.weight`.

A head padded beyond the config's vocab_size is cut to it, as SGLang cuts its logits.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

HEAD_NAMES = ("lm_head.weight", "language_model.lm_head.weight")
TIED_NAMES = (
    "model.embed_tokens.weight",
    "language_model.model.embed_tokens.weight",
    "model.language_model.embed_tokens.weight",
)
INDEX_FILE = "model.safetensors.index.json"
FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class LMHeadError(RuntimeError):
    pass


def text_config(model_path: Path) -> dict:
    config = json.loads((Path(model_path) / "config.json").read_text())
    return config.get("text_config") or config


def head_names(model_path: Path) -> tuple[str, ...]:
    """The tensor names the head may have, in order of preference."""
    return TIED_NAMES if text_config(model_path).get("tie_word_embeddings") else HEAD_NAMES


def tensor_files(model_path: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it: from the index, or every file's header."""
    from safetensors import safe_open

    model_path = Path(model_path)
    index = model_path / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: model_path / file for name, file in weight_map.items()}
    found: dict[str, Path] = {}
    for path in sorted(model_path.glob("*.safetensors")):
        with safe_open(path, framework="pt") as f:  # reads the header only
            found.update(dict.fromkeys(f.keys(), path))
    return found


def find_lm_head(model_path: Path) -> tuple[str, Path]:
    """(tensor name, file) of the model's output head; LMHeadError when there is none."""
    names, files = head_names(model_path), tensor_files(model_path)
    for name in names:
        if name in files:
            return name, files[name]
    tied = bool(text_config(model_path).get("tie_word_embeddings"))
    raise LMHeadError(
        f"{model_path}: no output head in the checkpoint: none of {list(names)} among its "
        f"{len(files)} safetensors tensors (config tie_word_embeddings: {tied})"
    )


def load_lm_head(model_path: Path, hidden_size: int) -> torch.Tensor:
    """The head's weight [vocab_size, hidden_size], in the checkpoint's dtype."""
    from safetensors import safe_open

    name, path = find_lm_head(model_path)
    with safe_open(path, framework="pt") as f:
        weight = f.get_tensor(name)
    where = f"{path.name}:{name}"
    if weight.dtype not in FLOAT_DTYPES:
        raise LMHeadError(f"{where} is {weight.dtype} (quantized?): the check needs a float head")
    vocab = text_config(model_path).get("vocab_size") or weight.shape[0]
    if weight.ndim != 2 or weight.shape[1] != hidden_size or weight.shape[0] < vocab:
        raise LMHeadError(
            f"{where} has shape {tuple(weight.shape)}, not [>= vocab_size {vocab}, hidden "
            f"{hidden_size}]"
        )
    return weight[:vocab]
