"""Make small, deterministic models locally: no hub, random weights, a tokenizer trained in seconds.

    python -m tools.tiny_models OUT_DIR [--only llama-tiny deepseek-v3-tiny qwen25-vl-tiny ...]

Each model lands in OUT_DIR/<name>/ as an ordinary HF checkpoint (config.json, bf16 safetensors,
tokenizer files with a chat template; `qwen25-vl-tiny` and `kimi-k25-tiny` also a processor)
that both SGLang and transformers load (`kimi-k25-tiny`'s SGLang processor is remote code: the
server needs --trust-remote-code). The same seed gives the same bytes, so a directory made
once can be re-used (`ensure_models` skips what is there). One is not random: `llama-trained`
is trained here (about two minutes on two CPU cores) on a corpus of rules
(tools/trained_target.py), so that its greedy answers are predictable and a draft can learn them.
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

from tools import trained_target

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
# Bumped whenever what a preset makes changes: older copies are then made again.
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


def _train_tokenizer(special_tokens: list[str]) -> Tokenizer:
    """Byte-level BPE on the corpus; the special tokens take ids 0..N-1, in order."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    return tok


def make_tokenizer() -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(
        tokenizer_object=_train_tokenizer(SPECIAL_TOKENS),
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


# Norm weights, which start near 1: the text models' and Qwen2.5-VL's vision tower's.
NORM_WEIGHTS = ("norm.weight", "norm1.weight", "norm2.weight", "ln_q.weight")


def _randomize(model: torch.nn.Module) -> None:
    """Seeded weights with more spread than HF's 0.02 init, so layers differ visibly."""
    g = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.endswith(NORM_WEIGHTS) or "layernorm" in name:
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
    _mark_complete(path, name)
    return path


def write_trained(name: str, out_dir: Path, tokenizer: PreTrainedTokenizerFast) -> Path:
    """llama_config's shape, trained in float32 on the rules corpus, saved in bf16 as the others;
    its generation config also ends a turn at <|im_end|>, as a chat model's does."""
    config = llama_config(tokenizer, hidden=TRAINED_HIDDEN, layers=TRAINED_LAYERS)
    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    stats = trained_target.train(model, tokenizer)
    model = model.to(torch.bfloat16)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, im_end]
    path = out_dir / name
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    report = trained_target.report(stats, trained_target.evaluate(model, tokenizer))
    (path / trained_target.REPORT_FILE).write_text(json.dumps(report, indent=2))
    _mark_complete(path, name)
    return path


# Six layers: EAGLE-3's aux layers [2, L // 2, L - 3] are three different ones.
TRAINED_HIDDEN, TRAINED_LAYERS = 128, 6
# Models trained here on the tokenizer above: name -> writer (name, out_dir, tokenizer).
TRAINED_PRESETS: dict[str, Callable[[str, Path, PreTrainedTokenizerFast], Path]] = {
    "llama-trained": write_trained,
}


def _mark_complete(path: Path, name: str) -> None:
    """Written last: a copy without it (or of another version) is made again."""
    marker = {"preset": name, "seed": SEED, "version": MODEL_VERSION}
    (path / "tiny_model.json").write_text(json.dumps(marker))


# -- a tiny Qwen2.5-VL: images through SGLang's multimodal path -------------------------------

# Qwen2.5's special tokens (its strings, our ids 0..13: <|vision_start|> 9, <|vision_end|> 10,
# <|image_pad|> 12, <|video_pad|> 13).
QWEN_SPECIAL_TOKENS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
]  # fmt: skip

# Qwen2.5-VL's own chat template: one <|vision_start|><|image_pad|><|vision_end|> per image
# part (the processor expands the pad), Qwen's default system prompt.
QWEN25_VL_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}"
    "{% endfor %}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Qwen2.5-VL's patch geometry: 14-pixel patches, 2x2 merged into one image token.
PATCH_SIZE, MERGE_SIZE, TEMPORAL_PATCH_SIZE = 14, 2, 2


def qwen25_vl_config(tokenizer: PreTrainedTokenizerFast) -> PretrainedConfig:
    """Text: hidden 128, 4 layers, head_dim 32, M-RoPE sections [4, 6, 6] (sum head_dim / 2).
    Vision: depth 2, hidden 64, one full-attention block, out_hidden 128 (the text's)."""
    from transformers import Qwen2_5_VLConfig

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in QWEN_SPECIAL_TOKENS}
    text = dict(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-6,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 1000000.0,
            "mrope_section": [4, 6, 6],
        },
        **_common(tokenizer) | {"bos_token_id": ids["<|endoftext|>"]},  # as Qwen2.5's
    )
    vision = dict(
        depth=2,
        hidden_size=64,
        intermediate_size=128,
        num_heads=2,
        in_channels=3,
        patch_size=PATCH_SIZE,
        spatial_merge_size=MERGE_SIZE,
        temporal_patch_size=TEMPORAL_PATCH_SIZE,
        tokens_per_second=2,
        window_size=112,
        out_hidden_size=128,
        fullatt_block_indexes=[1],
    )
    return Qwen2_5_VLConfig(
        architectures=["Qwen2_5_VLForConditionalGeneration"],
        text_config=text,
        vision_config=vision,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
        dtype="bfloat16",
    )


def write_qwen25_vl(name: str, out_dir: Path) -> Path:
    """The model, its own tokenizer (Qwen's special tokens) and its processor."""
    from transformers import (
        AutoModelForImageTextToText,
        Qwen2_5_VLProcessor,
        Qwen2VLImageProcessor,
        Qwen2VLVideoProcessor,
    )

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=_train_tokenizer(QWEN_SPECIAL_TOKENS),
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=QWEN25_VL_CHAT_TEMPLATE,
        model_max_length=4096,
    )
    torch.manual_seed(SEED)
    config = qwen25_vl_config(tokenizer)
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    _randomize(model)
    model = model.to(torch.bfloat16)
    for part in (model.config.text_config, model.config.vision_config):
        part.dtype = torch.bfloat16  # else from_config's float32 stays in the parts' configs
    path = out_dir / name
    model.save_pretrained(path, safe_serialization=True)
    geometry = dict(
        patch_size=PATCH_SIZE, temporal_patch_size=TEMPORAL_PATCH_SIZE, merge_size=MERGE_SIZE
    )
    processor = Qwen2_5_VLProcessor(
        # From 56x56 px (4 image tokens) up to 256 image tokens an image: cheap on CPU.
        image_processor=Qwen2VLImageProcessor(
            min_pixels=56 * 56, max_pixels=28 * 28 * 256, **geometry
        ),
        video_processor=Qwen2VLVideoProcessor(**geometry),
        tokenizer=tokenizer,
        chat_template=QWEN25_VL_CHAT_TEMPLATE,
    )
    processor.save_pretrained(path)
    _mark_complete(path, name)
    return path


# -- a tiny Kimi-K2.5: a DeepseekV3 language model and a MoonViT vision tower --------------------

# Kimi's markup tokens (our ids 0..12: <|media_begin|> 8, <|media_end|> 10, <|media_pad|> 11).
KIMI_SPECIAL_TOKENS = [
    "[BOS]", "[EOS]", "[PAD]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>",
    "<|im_middle|>", "<|media_begin|>", "<|media_content|>", "<|media_end|>", "<|media_pad|>",
    "<|kimi_k25_video_placeholder|>",
]  # fmt: skip

# Kimi-K2.5's turn markup (`<|im_user|>user<|im_middle|>...<|im_end|>`), one
# `<|media_begin|>image<|media_content|><|media_pad|><|media_end|>` per image part (the processor
# expands the pad); tools, calls, reasoning and `{% generation %}` as CHAT_TEMPLATE has them.
KIMI_CHAT_TEMPLATE = (
    "{% if tools %}<|im_system|>tool_declare<|im_middle|># Tools\n<tools>"
    "{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}"
    "{{ '\\n' }}</tools><|im_end|>{% endif %}"
    "{% for message in messages %}"
    "{% set role = message['role'] %}"
    "{% if role == 'user' %}<|im_user|>{% elif role == 'assistant' %}<|im_assistant|>"
    "{% else %}<|im_system|>{% endif %}{{ role }}<|im_middle|>"
    "{% if role == 'assistant' %}"
    "{% generation %}"
    "{% if message.reasoning_content %}<think>{{ message.reasoning_content }}</think>{% endif %}"
    "{% if message['content'] is string %}{{ message['content'] }}{% endif %}"
    "{% for call in message.tool_calls or [] %}"
    "{% if message['content'] or not loop.first %}{{ '\\n' }}{% endif %}<tool_call>\n"
    "{{ {'name': call.function.name, 'arguments': call.function.arguments} | tojson }}"
    "\n</tool_call>{% endfor %}"
    "<|im_end|>{% endgeneration %}"
    "{% elif message['content'] is string %}{{ message['content'] }}<|im_end|>"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "<|media_begin|>image<|media_content|><|media_pad|><|media_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}"
    "{% endfor %}<|im_end|>{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_assistant|>assistant<|im_middle|>{% endif %}"
)

# The model directory's remote-code processor (auto_map): transformers' Kimi_K25Processor plus
# what SGLang's kimi_k25 multimodal processor reads from the hub's own processor, a
# `media_processor` (`media_proc_cfg`, `media_tokens_calculator`) and `medias=` calls with the
# image tokens already expanded. Without trust_remote_code AutoProcessor gives Kimi_K25Processor.
KIMI_PROCESSOR_FILE = "processing_tiny_kimi_k25.py"
KIMI_PROCESSOR_SOURCE = """\
# Remote-code processor of the tiny Kimi-K2.5: transformers' Kimi_K25Processor plus the hub
# processor's `media_processor` and `medias=` interface that SGLang's kimi_k25 multimodal
# processor calls (its CPU path hands over text whose image tokens are already expanded).

from transformers import BatchFeature
from transformers.models.kimi_k25.processing_kimi_k25 import Kimi_K25Processor


class _MediaProcessor:
    def __init__(self, image_processor):
        self.image_processor = image_processor
        size = image_processor.size
        side = size["max_height"] if isinstance(size, dict) else size.max_height
        self.media_proc_cfg = {
            "patch_size": image_processor.patch_size,
            "merge_kernel_size": image_processor.merge_size,
            "in_patch_limit": image_processor.max_patches,
            "patch_limit_on_one_side": side,
            "image_mean": list(image_processor.image_mean),
            "image_std": list(image_processor.image_std),
        }

    def media_tokens_calculator(self, media):
        width, height = media["image"].size
        patches = self.image_processor.get_number_of_image_patches(height, width, {})
        return patches // self.image_processor.merge_size**2


class TinyKimiK25Processor(Kimi_K25Processor):
    def __init__(
        self, image_processor=None, tokenizer=None, video_processor=None, chat_template=None,
        **kwargs,
    ):
        super().__init__(
            image_processor, tokenizer, video_processor, chat_template=chat_template, **kwargs
        )
        self.media_processor = _MediaProcessor(self.image_processor)

    def __call__(self, text=None, images=None, videos=None, medias=None, **kwargs):
        if medias is None:
            return super().__call__(text=text, images=images, videos=videos, **kwargs)
        kwargs.pop("return_tensors", None)
        ids = self.tokenizer(text, return_tensors="pt")
        data = dict(ids)
        imgs = [m["image"] for m in medias if m["type"] == "image"]
        if imgs:
            out = self.image_processor(imgs, return_tensors="pt")
            data["pixel_values"] = out["pixel_values"]
            data["grid_thws"] = out["image_grid_thw"]
        return BatchFeature(data=data)


__all__ = ["TinyKimiK25Processor"]
"""

# transformers' save reverts its kimi_k25 load renames too broadly (language `layers` become
# `blocks`, the patch embedding and projector norm move): back to the hub checkpoint's names,
# which SGLang's loader and transformers' own conversion read.
_KIMI_NAME_FIXES = (
    ("language_model.model.blocks.", "language_model.model.layers."),
    ("vision_tower.encoder.patch_embed.", "vision_tower.patch_embed."),
    ("model.mm_projector.", "mm_projector."),
)
KIMI_PATCH_SIZE, KIMI_MERGE_SIZE = 14, 2


def _kimi_hub_names(file: Path) -> None:
    from safetensors.torch import load_file, save_file

    fixed = {}
    for key, value in load_file(file).items():
        for old, new in _KIMI_NAME_FIXES:
            if key.startswith(old):
                key = new + key[len(old) :]
        fixed[key] = value
    save_file(fixed, file, metadata={"format": "pt"})


def _update_json(file: Path, **fields: object) -> None:
    data = json.loads(file.read_text())
    for key, value in fields.items():
        if isinstance(value, dict) and isinstance(data.get(key), dict):
            data[key].update(value)
        else:
            data[key] = value
    file.write_text(json.dumps(data, indent=2))


def kimi_k25_config(tokenizer: PreTrainedTokenizerFast) -> PretrainedConfig:
    """Text: deepseek-v3-tiny's (MLA, MoE, YaRN). Vision: MoonViT depth 2, hidden 64, 2 heads,
    a 16x16 learned position grid, 2x2 patch merging into the text's hidden 256."""
    from transformers import Kimi_K25Config

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in KIMI_SPECIAL_TOKENS}
    text = deepseek_v3_config(tokenizer).to_dict()
    text.update(
        bos_token_id=ids["[BOS]"], eos_token_id=ids["<|im_end|>"], pad_token_id=ids["[PAD]"]
    )
    for key in ("architectures", "transformers_version", "dtype", "torch_dtype"):
        text.pop(key, None)
    vision = dict(
        patch_size=KIMI_PATCH_SIZE,
        pos_emb_height=16,
        pos_emb_width=16,
        pos_emb_time=4,
        num_attention_heads=2,
        num_hidden_layers=2,
        hidden_size=64,
        intermediate_size=128,
        hidden_act="gelu_pytorch_tanh",
        merge_kernel_size=[KIMI_MERGE_SIZE, KIMI_MERGE_SIZE],
        rope_parameters={"rope_type": "axial", "rope_theta": 10000.0},
    )
    return Kimi_K25Config(
        architectures=["KimiK25ForConditionalGeneration"],
        text_config=text,
        vision_config=vision,
        projection_hidden_size=64,
        projection_layer_norm_eps=1e-5,
        image_token_id=ids["<|media_pad|>"],
        video_token_id=ids["<|kimi_k25_video_placeholder|>"],
        vision_start_token_id=ids["<|media_begin|>"],
        vision_end_token_id=ids["<|media_end|>"],
        tie_word_embeddings=False,
        pad_token_id=ids["[PAD]"],
        dtype="bfloat16",
    )


def write_kimi_k25(name: str, out_dir: Path) -> Path:
    """The model in the hub checkpoint's layout, its tokenizer (Kimi's markup tokens) and a
    processor both transformers (Kimi_K25Processor) and SGLang (trust_remote_code) load."""
    from transformers import Kimi_K25ForConditionalGeneration, Kimi_K25Processor
    from transformers.models.kimi_k25.image_processing_kimi_k25 import Kimi_K25ImageProcessor
    from transformers.models.kimi_k25.video_processing_kimi_k25 import Kimi_K25VideoProcessor

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=_train_tokenizer(KIMI_SPECIAL_TOKENS),
        bos_token="[BOS]",
        eos_token="<|im_end|>",
        pad_token="[PAD]",
        extra_special_tokens={
            "image_token": "<|media_pad|>",
            "video_token": "<|kimi_k25_video_placeholder|>",
        },
        chat_template=KIMI_CHAT_TEMPLATE,
        model_max_length=4096,
    )
    torch.manual_seed(SEED)
    config = kimi_k25_config(tokenizer)
    model = Kimi_K25ForConditionalGeneration(config).to(torch.float32)
    _randomize(model)
    model = model.to(torch.bfloat16)
    for part in (model.config.text_config, model.config.vision_config):
        part.dtype = torch.bfloat16
    path = out_dir / name
    model.save_pretrained(path, safe_serialization=True)
    _kimi_hub_names(path / "model.safetensors")
    vision, text = config.vision_config, config.text_config
    # SGLang reads its own KimiK25Config from the same file, under the hub config's names.
    _update_json(
        path / "config.json",
        architectures=["KimiK25ForConditionalGeneration"],
        media_placeholder_token_id=config.image_token_id,
        # SGLang builds the language model from text_config and reads its architectures[0].
        text_config=dict(architectures=["DeepseekV3ForCausalLM"]),
        vision_config=dict(
            init_pos_emb_height=vision.pos_emb_height,
            init_pos_emb_width=vision.pos_emb_width,
            init_pos_emb_time=vision.pos_emb_time,
            pos_emb_type="divided_fixed",
            video_attn_type="spatial_temporal",
            merge_type="sd2_tpool",
            vt_hidden_size=vision.hidden_size,
            vt_num_attention_heads=vision.num_attention_heads,
            vt_num_hidden_layers=vision.num_hidden_layers,
            vt_intermediate_size=vision.intermediate_size,
            mm_projector_type="patchmerger",
            mm_hidden_size=vision.hidden_size,
            projector_hidden_act="gelu",
            projector_ln_eps=1e-5,
            text_hidden_size=text.hidden_size,
        ),
    )
    processor = Kimi_K25Processor(
        # At most 256 patches (64 image tokens) an image: cheap on CPU.
        image_processor=Kimi_K25ImageProcessor(
            max_patches=256, size={"max_height": 32, "max_width": 32}
        ),
        tokenizer=tokenizer,
        video_processor=Kimi_K25VideoProcessor(),
        chat_template=KIMI_CHAT_TEMPLATE,
    )
    processor.save_pretrained(path)
    (path / KIMI_PROCESSOR_FILE).write_text(KIMI_PROCESSOR_SOURCE)
    remote = KIMI_PROCESSOR_FILE.removesuffix(".py") + ".TinyKimiK25Processor"
    _update_json(path / "processor_config.json", auto_map={"AutoProcessor": remote})
    _mark_complete(path, name)
    return path


# Models that bring their own tokenizer and processor: name -> writer (name, out_dir).
MULTIMODAL_PRESETS: dict[str, Callable[[str, Path], Path]] = {
    "qwen25-vl-tiny": write_qwen25_vl,
    "kimi-k25-tiny": write_kimi_k25,
}
MODELS = (*PRESETS, *TRAINED_PRESETS, *MULTIMODAL_PRESETS)


def ensure_models(out_dir: Path, names: Iterable[str] = MODELS) -> dict[str, Path]:
    """Write the named models unless a complete copy is already in out_dir."""
    out_dir.mkdir(parents=True, exist_ok=True)
    names = list(names)
    missing = [n for n in names if _version(out_dir / n) != MODEL_VERSION]
    ours = (*PRESETS, *TRAINED_PRESETS)
    tokenizer = make_tokenizer() if any(n in ours for n in missing) else None
    for name in missing:
        if name in MULTIMODAL_PRESETS:
            MULTIMODAL_PRESETS[name](name, out_dir)
        elif name in TRAINED_PRESETS:
            assert tokenizer is not None
            TRAINED_PRESETS[name](name, out_dir, tokenizer)
        else:
            assert tokenizer is not None
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
    parser.add_argument("--only", nargs="+", choices=sorted(MODELS), default=sorted(MODELS))
    args = parser.parse_args()
    for name, path in ensure_models(args.out_dir, args.only).items():
        print(f"{name}: {path}")


if __name__ == "__main__":
    main()
