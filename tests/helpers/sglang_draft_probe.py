"""Runs in the project venv as a subprocess (never imported by the product or by pytest): loads
converted drafts the way an SGLang 0.5.23 server loads its EAGLE-3 draft, on CPU, without
starting one (ModelConfig of the draft directory, `get_model` with SGLang's loader, so its
LlamaForCausalLMEagle3.load_weights), and runs SGLang's own draft forward
(`LlamaForCausalLMEagle3.model`: fc, its decoder layers, the final norm, the state it feeds back)
on a reference input, for tests/integration/test_draft_convert.py.

    python tests/helpers/sglang_draft_probe.py TARGET_DIR OUT_JSON DRAFT_DIR=REF ...

Each draft's RadixAttention is the one part not SGLang's: it needs a server's KV pool and
attention backend, so it is swapped for causal scaled-dot-product attention over the same q, k, v
(speculators' sdpa over one document is that). Per draft in OUT_JSON: `loaded` (every parameter
compared with the tensors of the draft's file it must hold: `mismatched` lists those that differ
or that no tensor fills, `unused` the file's tensors no parameter took), the largest differences
of the logits and of the fed-back state from the reference's, and whether the target tokens
(through SGLang's hot_token_id) agree.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import types
from pathlib import Path

os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
# The tests' servers skip every model module but the tiny targets' (tests/conftest.py): the
# draft's own is needed here.
DISABLED = os.environ.get("SGLANG_DISABLED_MODEL_ARCHS", "").split(",")
os.environ["SGLANG_DISABLED_MODEL_ARCHS"] = ",".join(m for m in DISABLED if m != "llama_eagle3")

import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

STACKED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def start(target: str, first_draft: str):
    """One process-wide SGLang context (TP 1, gloo) that drafts are built in."""
    from sglang.srt.distributed import init_distributed_environment, initialize_model_parallel
    from sglang.srt.runtime_context import get_parallel, publish
    from sglang.srt.server_args import ServerArgs

    args = ServerArgs(
        model_path=target,
        device="cpu",
        dtype="float32",
        speculative_algorithm="EAGLE3",
        speculative_draft_model_path=first_draft,
        speculative_num_steps=3,
        speculative_eagle_topk=1,
        speculative_num_draft_tokens=4,
        attention_backend="torch_native",
        disable_cuda_graph=True,
    )
    publish(args, role="scheduler")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    init_distributed_environment(
        world_size=1,
        rank=0,
        local_rank=0,
        backend="gloo",
        distributed_init_method=f"tcp://127.0.0.1:{port}",
    )
    get_parallel().override_permanently(tp_rank=0, pp_rank=0)
    initialize_model_parallel()
    return args


def load_draft(args, draft: str):
    from sglang.srt.configs.device_config import DeviceConfig
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_loader import get_model

    config = ModelConfig.from_server_args(args, model_path=draft, is_draft_model=True)
    return get_model(
        model_config=config, load_config=LoadConfig(), device_config=DeviceConfig(device="cpu")
    )


def loaded(model, tensors: dict[str, torch.Tensor]) -> dict[str, list[str]]:
    """Every parameter against what it must hold from the file; the file's tensors none took.
    A draft layer after the first has an `input_layernorm` its forward never calls (it
    normalizes its input with `hidden_norm`): left out."""
    mismatched, used = [], {"d2t", "t2d"}
    for name, param in model.named_parameters():
        source = name.removeprefix("model.")
        parts = source.split(".")
        if parts[0] == "layers" and parts[1] != "0" and parts[2] == "input_layernorm":
            continue
        names = [source]
        if len(parts) > 1 and parts[-2] in STACKED:
            names = [".".join([*parts[:-2], p, parts[-1]]) for p in STACKED[parts[-2]]]
        if not all(n in tensors for n in names):
            mismatched.append(f"{name}: no tensor {names}")
            continue
        used |= set(names)
        want = torch.cat([tensors[n] for n in names]).to(param.dtype)
        if not torch.equal(param.detach(), want):
            mismatched.append(f"{name}: differs from {names}")
    return {"mismatched": mismatched, "unused": sorted(set(tensors) - used)}


def causal(attn):
    def forward(q, k, v, forward_batch, **_):
        t = q.shape[0]
        q = q.view(t, attn.tp_q_head_num, attn.head_dim).transpose(0, 1)
        k = k.view(t, attn.tp_k_head_num, attn.head_dim).transpose(0, 1)
        v = v.view(t, attn.tp_v_head_num, attn.v_head_dim).transpose(0, 1)
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=attn.scaling, enable_gqa=True
        )
        return out.transpose(0, 1).reshape(t, -1)

    return forward


def forward(model, ref: dict[str, torch.Tensor]) -> dict:
    """SGLang's draft forward in an extend batch whose spec_info holds the target's aux states."""
    for layer in model.model.layers:
        layer.self_attn.attn.forward = causal(layer.self_attn.attn)
    mode = types.SimpleNamespace(is_extend=lambda: True, is_draft_extend_v2=lambda: False)
    batch = types.SimpleNamespace(
        mm_input_embeds=None,
        forward_mode=mode,
        contains_mm_inputs=lambda: False,
        spec_info=types.SimpleNamespace(hidden_states=ref["hidden_states"]),
    )
    ids = ref["input_ids"]
    with torch.no_grad():
        to_logits, (fed_back,) = model.model(ids, torch.arange(len(ids)), batch)
        logits = torch.nn.functional.linear(to_logits, model.lm_head.weight)
    tokens = logits.argmax(-1)
    if model.hot_token_id is not None:  # as the EAGLE worker maps draft tokens
        tokens = model.hot_token_id[tokens]
    return {
        "logits_diff": float((logits - ref["logits"]).abs().max()),
        "logits_scale": float(ref["logits"].abs().max()),
        "fed_back_diff": float((fed_back - ref["fed_back"]).abs().max()),
        "fed_back_scale": float(ref["fed_back"].abs().max()),
        "tokens_equal": bool(torch.equal(tokens, ref["target_tokens"])),
        "hot_token_id": model.hot_token_id is not None,
    }


def main() -> None:
    target, out, pairs = sys.argv[1], Path(sys.argv[2]), [a.split("=") for a in sys.argv[3:]]
    args = start(target, pairs[0][0])
    results = {}
    for draft, ref in pairs:
        model = load_draft(args, draft)
        tensors = load_file(Path(draft) / "model.safetensors")
        results[Path(draft).name] = {
            **loaded(model, tensors),
            **forward(model, load_file(ref)),
            "num_layers": len(model.model.layers),
        }
    out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
