"""A tiny Llama whose bf16 serving is as noisy as a real model's, made from llama-tiny in a second.

llama-tiny's 8 layers differ from one prefill batching to another by ~1% in bf16 (below verify's
floor), while a real model's (SmolLM2-135M: 30 layers) differ by 3-7%. This one has llama-tiny's
layers three times over (24), attention and MLP inputs 3 x sharper (rounding grows through the
layers as in a deep trained model: measured alone vs batched 0-2.7% aux, 0-7.1% final), and the
massive activation real models put on the first token: two channels of the BOS embedding at
+-30, so that row's norm is ~75 x an ordinary embedding row's (48 vs ~30 through the layers).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer

REPEATS = 3
SHARPER = 3.0  # q, k (attention logits 9 x), gate and up projections
SHARPER_WEIGHTS = ("q_proj.weight", "k_proj.weight", "gate_proj.weight", "up_proj.weight")
MASSIVE = 30.0
MASSIVE_CHANNELS = (7, 91)


def noisy_llama(llama_tiny: Path, out: Path) -> Path:
    """The noisy model at `out` (made once: the same bytes every time)."""
    if (out / "config.json").exists():
        return out
    shutil.copytree(llama_tiny, out)
    weights = load_file(out / "model.safetensors")
    config = json.loads((out / "config.json").read_text())
    layers = config["num_hidden_layers"]
    for name in list(weights):
        if name.endswith(SHARPER_WEIGHTS):
            weights[name] = (weights[name].float() * SHARPER).to(torch.bfloat16)
    for name in [n for n in weights if n.startswith("model.layers.")]:
        index = int(name.split(".")[2])
        for copy in range(1, REPEATS):
            renamed = name.replace(f"layers.{index}.", f"layers.{index + copy * layers}.", 1)
            weights[renamed] = weights[name].clone()
    bos = AutoTokenizer.from_pretrained(out).bos_token_id
    embed = weights["model.embed_tokens.weight"].float()
    embed[bos, list(MASSIVE_CHANNELS)] = torch.tensor([MASSIVE, -MASSIVE])
    weights["model.embed_tokens.weight"] = embed.to(torch.bfloat16)
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    config["num_hidden_layers"] = layers * REPEATS
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "tiny_model.json").write_text(json.dumps({"preset": "llama-tiny-noisy"}))
    return out
