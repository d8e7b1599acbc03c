"""`draft-convert` (hsx_store/export/sglang_draft.py) on drafts in speculators' saved layout
(tests/helpers/drafts.py): the aux ids are those SGLang asks the store's target for (Llama adds 1,
DeepSeek takes them as given unless the first is 1), `--layer-shift` moves them on purpose, the
weights pass through bit for bit (renamed only where SGLang's draft layer names them otherwise),
SGLang's own ModelConfig reads the config as written, RoPE types are let through only where
SGLang's rotary equals transformers', and every draft SGLang would run with another forward, or
made for other data, is refused with its reason and nothing written. Real speculators drafts,
loaded by SGLang's loader and run against speculators' forward:
tests/integration/test_draft_convert.py."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from cluster.__main__ import main
from hsx_store.export.sglang_draft import ROPE_PARAMETERS
from tests.helpers.drafts import draft_store, speculators_draft

LLAMA_REQUESTED, LLAMA_LAYERS = [1, 3, 4], [2, 4, 5]  # Llama: hidden_states index = id + 1
DYNAMIC = {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}  # angles follow the length
YARN_FACTOR = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0, "attention_factor": 0.5}


def convert(*args: str | Path) -> int:
    return main(["draft-convert", *map(str, args)])


@pytest.fixture
def llama_store(tmp_path: Path, llama_path: Path) -> str:
    draft_store(tmp_path / "s.zarr", llama_path, LLAMA_REQUESTED)
    return str(tmp_path / "s.zarr")


def written(out: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    return json.loads((out / "config.json").read_text()), load_file(out / "model.safetensors")


def test_a_llama_draft_is_given_the_ids_sglang_asks_the_target_for(
    tmp_path: Path, llama_path: Path, llama_store: str, capsys: pytest.CaptureFixture
) -> None:
    draft = speculators_draft(tmp_path / "draft", llama_path, LLAMA_LAYERS)
    out = tmp_path / "sglang"
    assert convert("--draft", draft, "--store", llama_store, "--out", out) == 0
    said = capsys.readouterr().out
    assert "eagle_aux_hidden_state_layer_ids [1, 3, 4]" in said and "[2, 4, 5]" in said
    config, tensors = written(out)
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == LLAMA_REQUESTED
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["num_hidden_layers"] == 1 and config["target_hidden_size"] == 128
    assert config["vocab_size"] == config["draft_vocab_size"] == 1024
    assert config["dtype"] == "float32"  # the store's capture
    prov = config["hsx_draft_convert"]
    assert prov["store_layer_ids"] == prov["served_layer_ids"] == LLAMA_LAYERS
    assert prov["layer_shift"] == 0
    source = load_file(draft / "model.safetensors")
    assert tensors.keys() == source.keys()
    assert all(torch.equal(tensors[n], source[n]) for n in source)  # bit for bit, as saved


def test_sglang_reads_the_config_as_written(
    tmp_path: Path, llama_path: Path, llama_store: str
) -> None:
    """SGLang's own ModelConfig on the directory, and the fields its llama_eagle3.py reads."""
    os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
    from sglang.srt.configs.model_config import ModelConfig

    flags = {"norm_before_fc": True, "fc_norm": False, "norm_output": True}
    draft = speculators_draft(tmp_path / "draft", llama_path, LLAMA_LAYERS, **flags)
    assert convert("--draft", draft, "--store", llama_store, "--out", tmp_path / "out") == 0
    model = ModelConfig(str(tmp_path / "out"), is_draft_model=True, dtype="float32")
    hf = model.hf_config
    assert hf.architectures == ["LlamaForCausalLMEagle3"] and model.num_hidden_layers == 1
    assert hf.eagle_config["eagle_aux_hidden_state_layer_ids"] == LLAMA_REQUESTED
    assert hf.eagle_config.get("use_aux_hidden_state", True) is True
    # llama_eagle3.py: norm_before_fc from eagle_config first; fc_norm, norm_output from the config.
    assert hf.eagle_config.get("norm_before_fc", getattr(hf, "norm_before_fc", False)) is True
    assert getattr(hf, "fc_norm", None) is False and getattr(hf, "norm_output", False) is True
    assert hf.draft_vocab_size == 1024 and hf.target_hidden_size == 128
    assert hf.tie_word_embeddings is False and hf.head_dim == 32
    assert hf.rope_parameters["rope_theta"] == 10000.0 and model.dtype == torch.float32


@pytest.mark.parametrize(
    "requested,layers,ids",
    [([0, 1, 3], [0, 1, 3], [0, 1, 3]), ([2, 3, 1], [1, 2, 3], [2, 3, 1])],
)
def test_a_deepseek_draft_is_given_ids_as_deepseek_takes_them(
    tmp_path: Path, deepseek_path: Path, requested: list[int], layers: list[int], ids: list[int]
) -> None:
    """DeepSeek-style targets take ids as given unless the first is 1 (then all + 1): layer 1
    is asked for last."""
    store = draft_store(tmp_path / "s.zarr", deepseek_path, requested)
    assert store.manifest.layer_ids == layers
    draft = speculators_draft(tmp_path / "draft", deepseek_path, layers)
    assert convert("--draft", draft, "--store", tmp_path / "s.zarr", "--out", tmp_path / "o") == 0
    config, _ = written(tmp_path / "o")
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == ids
    assert config["hsx_draft_convert"]["served_layer_ids"] == layers
    assert config["target_hidden_size"] == config["hidden_size"] == 256


def test_layer_shift_serves_other_layers_on_purpose_and_says_so(
    tmp_path: Path, llama_path: Path, llama_store: str, capsys: pytest.CaptureFixture
) -> None:
    draft = speculators_draft(tmp_path / "draft", llama_path, LLAMA_LAYERS)
    out = tmp_path / "shifted"
    args = ["--draft", draft, "--store", llama_store, "--out", out, "--layer-shift", "1"]
    assert convert(*args) == 0
    said = capsys.readouterr().out
    assert "--layer-shift 1: a diagnostic" in said and "[3, 5, 6], not [2, 4, 5]" in said
    config, _ = written(out)
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    assert config["hsx_draft_convert"]["served_layer_ids"] == [3, 5, 6]
    assert config["hsx_draft_convert"]["layer_shift"] == 1


def test_a_layer_shift_beyond_the_target_exits_2_naming_it(
    tmp_path: Path, deepseek_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """DeepSeek [0, 1, 3] + 1 = [1, 2, 4]: its first id is 1, so SGLang reads [2, 3, 5], and
    the 4-layer model has no 5."""
    draft_store(tmp_path / "s.zarr", deepseek_path, [0, 1, 3])
    draft = speculators_draft(tmp_path / "draft", deepseek_path, [0, 1, 3])
    args = ["--draft", draft, "--store", tmp_path / "s.zarr", "--out", tmp_path / "o"]
    assert convert(*args, "--layer-shift", "1") == 2
    err = capsys.readouterr().err
    assert (
        "--layer-shift 1: aux layer ids [1, 2, 4] resolve to hidden_states indices [2, 3, 5]" in err
    )
    assert not (tmp_path / "o").exists()


def test_norm_before_residual_is_refused_saying_why_and_how_to_train(
    tmp_path: Path, llama_path: Path, llama_store: str, capsys: pytest.CaptureFixture
) -> None:
    draft = speculators_draft(
        tmp_path / "draft", llama_path, LLAMA_LAYERS, norm_before_residual=True
    )
    out = tmp_path / "out"
    assert convert("--draft", draft, "--store", llama_store, "--out", out) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"refused: {draft}: SGLang's LlamaForCausalLMEagle3 would not run")
    assert "norm_before_residual is true" in err and "hidden_norm(fc(aux))" in err
    assert "--no-norm-before-residual" in err and "norm_before_residual=False" in err
    assert not out.exists()


@pytest.mark.parametrize(
    "kwargs,reason",
    [
        ({"embed_requires_grad": True}, "replaces them with the target's"),
        ({"layer": {"model_type": "qwen3"}}, "decoder layer is 'qwen3'"),
        ({"layer": {"layer_types": ["sliding_attention"]}}, "--speculative-draft-window-size"),
        ({"layer": {"attention_bias": True}}, "no q/k/v or MLP biases"),
        ({"layer": {"mlp_bias": True}}, "no q/k/v or MLP biases"),
        ({"layer": {"hidden_act": "gelu"}}, "runs silu only"),
        ({"layer": {"partial_rotary_factor": 0.5}}, "partial_rotary_factor"),
        ({"layer": {"rope_parameters": DYNAMIC}}, "SGLang's rotary equals transformers' for"),
        ({"layer": {"rope_parameters": YARN_FACTOR}}, "SGLang's rotary equals transformers' for"),
        ({"layer_ids": [2, 4, 6]}, "store's layers [2, 4, 5]: train with --target-layer-ids 2 4"),
        ({"layer_ids": [2, 4]}, "are not the store's layers"),
        ({"target_hidden_size": 256}, "the store's states are 128 wide"),
        ({"drop": ("layers.0.hidden_norm.weight",)}, "tensors missing"),
        ({"drop": ("input_norm.weight",), "norm_before_fc": True}, "['input_norm.weight']"),
        ({"extra": ("fc_norm.0.weight",)}, "no parameter for (dropped): ['fc_norm.0.weight']"),
        ({"speculators_model_type": "dflash"}, "serves eagle3"),
    ],
)  # fmt: skip
def test_what_sglang_would_run_otherwise_is_refused_with_its_reason(
    tmp_path: Path,
    llama_path: Path,
    llama_store: str,
    capsys: pytest.CaptureFixture,
    kwargs: dict,
    reason: str,
) -> None:
    layer_ids = kwargs.pop("layer_ids", LLAMA_LAYERS)
    draft = speculators_draft(tmp_path / "draft", llama_path, layer_ids, **kwargs)
    assert convert("--draft", draft, "--store", llama_store, "--out", tmp_path / "out") == 1
    assert reason in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_draft_for_another_vocabulary_is_refused(
    tmp_path: Path, llama_path: Path, llama_store: str, capsys: pytest.CaptureFixture
) -> None:
    draft = speculators_draft(tmp_path / "draft", llama_path, LLAMA_LAYERS, draft_vocab_size=256)
    tensors = load_file(draft / "model.safetensors")
    tensors["d2t"] = tensors["d2t"] + 900  # maps draft tokens beyond the target's 1024
    from safetensors.torch import save_file

    save_file(tensors, draft / "model.safetensors")
    assert convert("--draft", draft, "--store", llama_store, "--out", tmp_path / "out") == 1
    assert "does not map the 256 draft tokens to distinct target tokens in 0..1023" in (
        capsys.readouterr().err
    )


@pytest.mark.parametrize("flag", ["norm_before_fc", "fc_norm", "norm_output"])
def test_the_flags_sglang_runs_as_trained_are_mapped_where_it_reads_them(
    tmp_path: Path, llama_path: Path, llama_store: str, flag: str
) -> None:
    draft = speculators_draft(tmp_path / "draft", llama_path, LLAMA_LAYERS, **{flag: True})
    assert convert("--draft", draft, "--store", llama_store, "--out", tmp_path / "out") == 0
    config, tensors = written(tmp_path / "out")
    where = config["eagle_config"] if flag == "norm_before_fc" else config
    assert where[flag] is True
    others = {"norm_before_fc": config["eagle_config"]["norm_before_fc"]}
    others |= {k: config[k] for k in ("fc_norm", "norm_output")}
    assert [k for k, v in others.items() if v] == [flag]
    assert tensors.keys() == load_file(draft / "model.safetensors").keys()


def test_a_pruned_vocabulary_keeps_d2t_for_sglangs_hot_token_ids(
    tmp_path: Path, llama_path: Path, llama_store: str
) -> None:
    draft = speculators_draft(tmp_path / "draft", llama_path, LLAMA_LAYERS, draft_vocab_size=256)
    assert convert("--draft", draft, "--store", llama_store, "--out", tmp_path / "out") == 0
    config, tensors = written(tmp_path / "out")
    assert config["draft_vocab_size"] == 256 and config["vocab_size"] == 1024
    assert torch.equal(tensors["d2t"], load_file(draft / "model.safetensors")["d2t"])
    assert tensors["lm_head.weight"].shape == (256, 128)


def test_later_layers_input_norm_is_named_as_sglangs_draft_layer_calls_it(
    tmp_path: Path, llama_path: Path, llama_store: str
) -> None:
    """SGLang's layers after the first normalize their input with `hidden_norm`."""
    draft = speculators_draft(tmp_path / "draft", llama_path, LLAMA_LAYERS, num_layers=2)
    assert convert("--draft", draft, "--store", llama_store, "--out", tmp_path / "out") == 0
    config, tensors = written(tmp_path / "out")
    source = load_file(draft / "model.safetensors")
    assert config["num_hidden_layers"] == 2
    assert torch.equal(
        tensors["layers.1.hidden_norm.weight"], source["layers.1.input_layernorm.weight"]
    )
    assert "layers.1.input_layernorm.weight" not in tensors
    assert torch.equal(
        tensors["layers.0.input_layernorm.weight"], source["layers.0.input_layernorm.weight"]
    )
    assert set(tensors) == set(source) - {"layers.1.input_layernorm.weight"} | {
        "layers.1.hidden_norm.weight"
    }


def test_the_target_comes_from_the_manifest_or_model_and_must_be_the_stores(
    tmp_path: Path, llama_path: Path, deepseek_path: Path, capsys: pytest.CaptureFixture
) -> None:
    draft_store(tmp_path / "s.zarr", llama_path, LLAMA_REQUESTED, model="/nowhere/llama")
    draft = speculators_draft(tmp_path / "draft", llama_path, LLAMA_LAYERS)
    args = ["--draft", draft, "--store", tmp_path / "s.zarr", "--out", tmp_path / "out"]
    assert convert(*args) == 2
    assert "the store's model '/nowhere/llama' is not a directory here: pass --model" in (
        capsys.readouterr().err
    )
    assert convert(*args, "--model", deepseek_path) == 2
    err = capsys.readouterr().err
    assert "model_config_hash" in err and "not the model that made the store" in err
    assert not (tmp_path / "out").exists()
    assert convert(*args, "--model", llama_path) == 0


def test_what_cannot_be_read_exits_2_naming_it(
    tmp_path: Path, llama_path: Path, llama_store: str, capsys: pytest.CaptureFixture
) -> None:
    draft = speculators_draft(tmp_path / "draft", llama_path, LLAMA_LAYERS)
    out = tmp_path / "out"
    assert convert("--draft", draft, "--store", tmp_path / "none.zarr", "--out", out) == 2
    assert f"{tmp_path / 'none.zarr'}: no store there" in capsys.readouterr().err
    assert convert("--draft", tmp_path / "nothing", "--store", llama_store, "--out", out) == 2
    assert f"{tmp_path / 'nothing' / 'config.json'} does not exist" in capsys.readouterr().err
    out.mkdir()
    (out / "model-00001-of-00002.safetensors").write_bytes(b"")
    assert convert("--draft", draft, "--store", llama_store, "--out", out) == 2
    assert "holds other weights, which SGLang would load too: ['model-00001-of-00002" in (
        capsys.readouterr().err
    )
    (out / "model-00001-of-00002.safetensors").unlink()
    assert convert("--draft", draft, "--store", llama_store, "--out", out) == 0
    assert convert("--draft", draft, "--store", llama_store, "--out", out) == 0  # over itself
    capsys.readouterr()
    out = tmp_path / "out2"
    (draft / "model.safetensors").write_bytes(b"not safetensors")
    assert convert("--draft", draft, "--store", llama_store, "--out", out) == 2
    assert f"{draft}: its safetensors cannot be read" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "default", "rope_theta": 50000.0},
        {"rope_type": "linear", "rope_theta": 10000.0, "factor": 3.0},
        {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 2.0,
         "high_freq_factor": 8.0, "original_max_position_embeddings": 256},
        {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0,
         "original_max_position_embeddings": 512, "beta_fast": 16.0, "beta_slow": 2.0},
        {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0},
        {"rope_type": "yarn", "rope_theta": 50000.0, "factor": 32.0,  # DeepSeek-V3 / Kimi-K2's
         "original_max_position_embeddings": 128, "beta_fast": 1.0, "beta_slow": 1.0,
         "mscale": 1.0, "mscale_all_dim": 1.0},
        {"rope_type": "yarn", "rope_theta": 50000.0, "factor": 32.0,
         "original_max_position_embeddings": 128, "mscale": 0.7, "mscale_all_dim": 1.0},
        {"rope_type": "yarn", "rope_theta": 50000.0, "factor": 8.0,
         "original_max_position_embeddings": 512, "truncate": False},
    ],
)  # fmt: skip
def test_the_rope_let_through_rotates_as_in_transformers(
    rope: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    """speculators' draft layer rotates with transformers' LlamaRotaryEmbedding (built on its
    config with the hidden size doubled); SGLang's with get_rope from the written config. Every
    RoPE type draft-convert lets through, with each parameter it may set."""
    import copy

    from sglang.srt.layers.rotary_embedding import base, get_rope
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    assert set(rope) - {"rope_type"} <= ROPE_PARAMETERS[rope["rope_type"]]
    heads, head_dim, positions, max_pos = 4, 32, 4096, 4096
    config = LlamaConfig(
        hidden_size=128,
        num_attention_heads=heads,
        num_key_value_heads=2,
        head_dim=head_dim,
        max_position_embeddings=max_pos,
        rope_parameters=dict(rope),
    )
    doubled = copy.copy(config)
    doubled.hidden_size *= 2  # as speculators' Eagle3DraftModel builds its rotary
    g = torch.Generator().manual_seed(0)
    q, k = (
        torch.randn(1, heads, positions, head_dim, generator=g),
        torch.randn(1, 2, positions, 32, generator=g),
    )
    pos = torch.arange(positions)
    cos, sin = LlamaRotaryEmbedding(doubled)(q, pos[None])
    q_hf, k_hf = apply_rotary_pos_emb(q, k, cos, sin)
    scaling = dict(config.rope_parameters)  # as SGLang's LlamaDecoderLayer passes it
    # As SGLANG_USE_CPU_ENGINE=1 imports it (here sglang may be imported without it): the
    # rotary's CPU branch, no vllm kernel.
    monkeypatch.setattr(base, "_is_cpu", True)
    rotary = get_rope(
        head_dim, rotary_dim=head_dim, max_position=max_pos, base=scaling["rope_theta"],
        rope_scaling=scaling, is_neox_style=True, dtype=torch.float32,
    )  # fmt: skip
    flat = [x[0].transpose(0, 1).reshape(positions, -1).clone() for x in (q, k)]
    q_sgl, k_sgl = rotary.forward_native(pos, *flat)
    back = [x.reshape(positions, -1, head_dim).transpose(0, 1)[None] for x in (q_sgl, k_sgl)]
    # Equal but for float32 rounding of the angles, which grows with the position: 0 for most
    # types, 4.5e-4 at position 4095 for linear's position / 3 (SGLang) vs inv_freq / 3 (HF).
    assert torch.allclose(back[0], q_hf, atol=1e-3) and torch.allclose(back[1], k_hf, atol=1e-3)
    assert not torch.allclose(q_hf, q, atol=1e-3)  # it rotated
