"""Runs inside .venv-trainers (never imported by the product or by pytest): makes EAGLE-3 drafts
with vLLM speculators 0.9.0's own code, as `speculators train` builds them
(`create_transformer_layer_config` + `Eagle3DraftModel.from_training_args`), saves each with
`save_pretrained`, and runs speculators' own forward on a random input, for
tests/integration/test_draft_convert.py to compare with SGLang's forward of the converted draft.

    python tests/helpers/speculators_drafts.py VERIFIER_DIR OUT_DIR SPECS_JSON

SPECS_JSON: a list of {"name", "layer_ids", and any of "num_layers", "draft_vocab_size",
"norm_before_residual", "norm_before_fc", "fc_norm", "norm_output"}. Per spec: OUT_DIR/NAME (the
draft) and OUT_DIR/NAME.ref.safetensors: `hidden_states` [T, num_aux * H] and `input_ids` [T]
(the input, at positions 0..T-1), `logits` [T, draft vocab] and `fed_back` [T, H] (what the next
speculative step takes: the layers' output, normalized with norm_output) of its first step, and
`target_tokens` [T] (the argmax in the target's vocabulary, through d2t).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

TOKENS = 24


def make_draft(verifier: str, spec: dict) -> torch.nn.Module:
    from speculators.models.eagle3.core import Eagle3DraftModel
    from speculators.train.cli import create_transformer_layer_config
    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution
    from transformers import AutoConfig

    num_layers = spec.get("num_layers", 1)
    vocab = AutoConfig.from_pretrained(verifier).vocab_size
    drafted = spec.get("draft_vocab_size", vocab)
    t2d = d2t = None
    if drafted < vocab:  # as --draft-vocab-size prunes it from token_freq.pt
        freq = {t: (t * 7919) % 1000 + 1 for t in range(vocab)}
        d2t, t2d = build_vocab_mappings_from_distribution(freq, drafted, vocab)
    layer = create_transformer_layer_config(
        verifier, num_layers, "llama", None, 2048, list(range(num_layers))
    )
    model = Eagle3DraftModel.from_training_args(
        verifier_config=layer,
        t2d=t2d,
        d2t=d2t,
        target_layer_ids=spec["layer_ids"],
        verifier_name_or_path=verifier,
        draft_attn_impl="sdpa",
        draft_vocab_size=drafted,
        norm_before_residual=spec.get("norm_before_residual", False),
        norm_before_fc=spec.get("norm_before_fc", False),
        fc_norm=spec.get("fc_norm", False),
        norm_output=spec.get("norm_output", False),
        ttt_steps=3,
    )
    g = torch.Generator().manual_seed(len(spec["name"]))
    with torch.no_grad():  # norms start at 1: move them, so a norm applied twice or not shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.mul_(1 + 0.3 * torch.randn(p.shape, generator=g))
            elif p.requires_grad:
                p.normal_(0, 0.1, generator=g)
    return model.eval()


def reference(model: torch.nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """speculators' forward, its first speculative step (ttt_steps=1), one document."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(1, TOKENS, model.fc.in_features, generator=g)
    ids = torch.randint(0, model.embed_tokens.num_embeddings, (1, TOKENS), generator=g)
    seen: dict[str, torch.Tensor] = {}
    model.layers[-1].register_forward_hook(lambda m, i, o: seen.setdefault("layers", o))
    model.norm.register_forward_hook(lambda m, i, o: seen.setdefault("norm", o))
    model.lm_head.register_forward_hook(lambda m, i, o: seen.setdefault("logits", o))
    with torch.no_grad():
        (tokens,) = model(
            hidden,
            ids,
            torch.zeros(1, TOKENS, dtype=torch.long),
            position_ids=torch.arange(TOKENS)[None],
            ttt_steps=1,
        )
    tokens = tokens[0]
    if model.d2t is not None:  # speculators' draft id -> target id
        tokens = tokens + model.d2t[tokens]
    fed_back = seen["norm"] if model.config.norm_output else seen["layers"]
    return {
        "hidden_states": hidden[0],
        "input_ids": ids[0],
        "logits": seen["logits"][0],
        "fed_back": fed_back[0],
        "target_tokens": tokens,
    }


def main() -> None:
    verifier, out = sys.argv[1], Path(sys.argv[2])
    for k, spec in enumerate(json.loads(sys.argv[3])):
        torch.manual_seed(k)
        model = make_draft(verifier, spec)
        model.save_pretrained(out / spec["name"])
        tensors = {n: t.contiguous() for n, t in reference(model, k).items()}
        save_file(tensors, out / f"{spec['name']}.ref.safetensors")


if __name__ == "__main__":
    main()
