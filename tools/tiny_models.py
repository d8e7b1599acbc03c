"""Make small, deterministic models locally: no hub, random weights, a tokenizer trained in seconds.

    python -m tools.tiny_models OUT_DIR [--only llama-tiny deepseek-v3-tiny ...]

Each model lands in OUT_DIR/<name>/ as an ordinary HF checkpoint (config.json, bf16 safetensors,
tokenizer files with a chat template) that both SGLang and transformers load. The same seed gives
the same bytes, so a directory made once can be re-used (`ensure_models` skips what is there).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (
    AutoModelForCausalLM,
    DeepseekV3Config,
    LlamaConfig,
    PretrainedConfig,
    PreTrainedTokenizerFast,
)

SEED = 1234
VOCAB_SIZE = 1024
SPECIAL_TOKENS = ["<|pad|>", "<|bos|>", "<|eos|>", "<|im_start|>", "<|im_end|>"]

# ChatML with tools (Qwen2.5's way: definitions in a system turn, each call a <tool_call> of
# JSON) and reasoning (a <think> block before the content). `{% generation %}` marks every
# token the assistant writes, so `apply_chat_template(..., return_assistant_tokens_mask=True)`
# yields the loss mask. A row without tools, calls or reasoning renders as plain ChatML.
CHAT_TEMPLATE = (  # Jinja runs with trim_blocks: a newline right after a tag is an expression
    "{{ bos_token }}"
    "{% if tools %}<|im_start|>system\n# Tools\n<tools>"
    "{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}"
    "{{ '\\n' }}</tools><|im_end|>\n{% endif %}"
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['role'] == 'assistant' %}"
    "{% generation %}"
    "{% if message.reasoning_content %}<think>\n{{ message.reasoning_content }}\n</think>\n\n"
    "{% endif %}"
    "{{ message['content'] }}"
    "{% for call in message.tool_calls or [] %}"
    "{% if message['content'] or not loop.first %}{{ '\\n' }}{% endif %}<tool_call>\n"
    "{{ {'name': call.function.name, 'arguments': call.function.arguments} | tojson }}"
    "\n</tool_call>{% endfor %}"
    "<|im_end|>{% endgeneration %}\n"
    "{% else %}{{ message['content'] }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Bumped whenever what write_model makes changes: older copies are then made again.
MODEL_VERSION = 2

_WORDS = (
    "the of and to in is that for it as with was on be by this are from at or an have not "
    "which model layer token hidden state draft target speculative decoding prefill batch "
    "request server cluster node shard queue lease store chunk array sample prompt answer "
    "question user assistant system capital city france paris river mountain ocean history "
    "science music number time world people water light energy computer language learning "
    "training data attention memory value"
).split()


def _corpus(lines: int = 4000) -> Iterable[str]:
    """Pseudo-English with digits and punctuation: enough for BPE merges, made offline."""
    g = torch.Generator().manual_seed(SEED)
    for i in range(lines):
        n = int(torch.randint(4, 24, (1,), generator=g))
        idx = torch.randint(0, len(_WORDS), (n,), generator=g).tolist()
        yield " ".join(_WORDS[j] for j in idx) + f" {i % 97}. Why? Yes, it's {i}!"


def make_tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|bos|>",
        eos_token="<|eos|>",
        pad_token="<|pad|>",
        chat_template=CHAT_TEMPLATE,
        model_max_length=4096,
    )


def _common(tokenizer: PreTrainedTokenizerFast) -> dict:
    return dict(
        vocab_size=VOCAB_SIZE,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        dtype="bfloat16",
    )


def llama_config(tokenizer: PreTrainedTokenizerFast, hidden: int, layers: int) -> LlamaConfig:
    return LlamaConfig(
        architectures=["LlamaForCausalLM"],
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 32,
        num_key_value_heads=hidden // 64,
        head_dim=32,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        **_common(tokenizer),
    )


def deepseek_v3_config(tokenizer: PreTrainedTokenizerFast) -> DeepseekV3Config:
    """Kimi-K2 in miniature: MLA, one dense layer then MoE with a shared expert, sigmoid
    noaux_tc routing, YaRN rope. kv_lora_rank != v_head_dim on purpose: equal sizes hide the
    SGLang CPU MLA bug that patches/mla_cpu_fix.py repairs."""
    config = DeepseekV3Config(
        architectures=["DeepseekV3ForCausalLM"],
        hidden_size=256,
        intermediate_size=512,
        moe_intermediate_size=64,
        num_hidden_layers=4,
        first_k_dense_replace=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=96,
        kv_lora_rank=64,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        routed_scaling_factor=2.827,
        norm_topk_prob=True,
        rms_norm_eps=1e-6,
        rope_interleave=True,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 50000.0,
            "factor": 32.0,
            "original_max_position_embeddings": 128,
            "beta_fast": 1.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        num_nextn_predict_layers=0,
        **_common(tokenizer),
    )
    # Fields SGLang's DeepSeek loader reads that transformers no longer defines.
    config.update(
        dict(
            moe_layer_freq=1,
            ep_size=1,
            aux_loss_alpha=0.001,
            seq_aux=True,
            topk_method="noaux_tc",
            scoring_func="sigmoid",
        )
    )
    return config


PRESETS: dict[str, Callable[[PreTrainedTokenizerFast], PretrainedConfig]] = {
    "llama-tiny": lambda tok: llama_config(tok, hidden=128, layers=8),
    "deepseek-v3-tiny": deepseek_v3_config,
    # Benchmark size: the capture-overhead target is stated for hidden >= 512, >= 8 layers.
    "llama-bench": lambda tok: llama_config(tok, hidden=512, layers=8),
}


def _randomize(model: torch.nn.Module) -> None:
    """Seeded weights with more spread than HF's 0.02 init, so layers differ visibly."""
    g = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.endswith("norm.weight") or "layernorm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif "e_score_correction_bias" in name:
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
        for name, buf in model.named_buffers():
            if "e_score_correction_bias" in name:
                buf.zero_()


def write_model(name: str, out_dir: Path, tokenizer: PreTrainedTokenizerFast) -> Path:
    config = PRESETS[name](tokenizer)
    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomize(model)
    model = model.to(torch.bfloat16)
    path = out_dir / name
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    marker = {"preset": name, "seed": SEED, "version": MODEL_VERSION}
    (path / "tiny_model.json").write_text(json.dumps(marker))
    return path


def ensure_models(out_dir: Path, names: Iterable[str] = tuple(PRESETS)) -> dict[str, Path]:
    """Write the named models unless a complete copy is already in out_dir."""
    out_dir.mkdir(parents=True, exist_ok=True)
    missing = [n for n in names if _version(out_dir / n) != MODEL_VERSION]
    tokenizer = make_tokenizer() if missing else None
    for name in missing:
        write_model(name, out_dir, tokenizer)
    return {n: out_dir / n for n in names}


def _version(path: Path) -> int | None:
    try:
        return json.loads((path / "tiny_model.json").read_text()).get("version")
    except (OSError, ValueError):
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--only", nargs="+", choices=sorted(PRESETS), default=sorted(PRESETS))
    args = parser.parse_args()
    for name, path in ensure_models(args.out_dir, args.only).items():
        print(f"{name}: {path}")


if __name__ == "__main__":
    main()
