"""Model directories derived from the tiny models: a fine-tune's look-alike, an indexed copy."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file


def fine_tuned_copy(model: Path, to: Path) -> Path:
    """A copy of `model` whose weights moved a little, as a fine-tune's do: same config,
    tokenizer, tensor names, shapes, dtypes and file sizes."""
    shutil.copytree(model, to)
    generator = torch.Generator().manual_seed(0)
    for path in to.glob("*.safetensors"):
        tensors = load_file(path)
        for name, tensor in tensors.items():
            noise = torch.randn(tensor.shape, generator=generator) * 1e-2
            tensors[name] = (tensor.float() + noise).to(tensor.dtype)
        save_file(tensors, path, metadata={"format": "pt"})
    return to


def indexed_copy(model: Path, to: Path) -> Path:
    """The tiny model with a `model.safetensors.index.json`: SpecForge's TargetHead finds the
    lm_head only through one (real checkpoints are sharded and have it)."""
    to.mkdir()
    for f in model.iterdir():
        (to / f.name).symlink_to(f)
    with safe_open(str(model / "model.safetensors"), "pt") as f:
        index = {"metadata": {}, "weight_map": dict.fromkeys(f.keys(), "model.safetensors")}
    (to / "model.safetensors.index.json").write_text(json.dumps(index))
    return to


HEAD_VOCAB, HEAD_HIDDEN = 12, 4


def head_checkpoint(
    path: Path, names: list[str], config: dict, index: bool
) -> dict[str, torch.Tensor]:
    """A checkpoint of two safetensors files holding `names` (and a decoy), with or without
    model.safetensors.index.json."""
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"vocab_size": HEAD_VOCAB, **config}))
    g = torch.Generator().manual_seed(0)
    tensors = {
        n: torch.randn(HEAD_VOCAB, HEAD_HIDDEN, generator=g).to(torch.bfloat16) for n in names
    }
    files = {"model-00001-of-00002.safetensors": {"model.norm.weight": torch.ones(HEAD_HIDDEN)}}
    files["model-00002-of-00002.safetensors"] = tensors
    for file, part in files.items():
        save_file(part, path / file)
    if index:
        weight_map = {n: file for file, part in files.items() for n in part}
        (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return tensors
