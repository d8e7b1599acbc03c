"""The output head, read alone from a checkpoint's safetensors for the logprob check."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from hsx_store.lm_head import LMHeadError, find_lm_head, load_lm_head
from tests.helpers.models import HEAD_HIDDEN, HEAD_VOCAB, head_checkpoint


@pytest.mark.parametrize("index", [True, False], ids=["index", "headers"])
@pytest.mark.parametrize(
    "names,config,expected",
    [
        (["lm_head.weight", "model.embed_tokens.weight"], {}, "lm_head.weight"),
        (
            ["language_model.lm_head.weight", "language_model.model.embed_tokens.weight"],
            {"text_config": {"vocab_size": HEAD_VOCAB, "tie_word_embeddings": False}},
            "language_model.lm_head.weight",
        ),
        (["model.embed_tokens.weight"], {"tie_word_embeddings": True}, "model.embed_tokens.weight"),
        (
            ["model.language_model.embed_tokens.weight"],
            {"text_config": {"tie_word_embeddings": True}},
            "model.language_model.embed_tokens.weight",
        ),
    ],
    ids=["llama", "kimi-k2.5", "tied", "tied-multimodal"],
)
def test_the_head_is_found_by_its_name_and_loaded_alone(
    tmp_path: Path, names: list[str], config: dict, expected: str, index: bool
) -> None:
    tensors = head_checkpoint(tmp_path / "m", names, config, index)
    name, file = find_lm_head(tmp_path / "m")
    assert (name, file.name) == (expected, "model-00002-of-00002.safetensors")
    assert torch.equal(load_lm_head(tmp_path / "m", HEAD_HIDDEN), tensors[expected])


def test_a_missing_misshapen_or_quantized_head_is_named(tmp_path: Path) -> None:
    head_checkpoint(
        tmp_path / "tied", ["lm_head.weight"], {"tie_word_embeddings": True}, index=False
    )
    with pytest.raises(LMHeadError, match=r"no output head .* none of \['model.embed_tokens"):
        load_lm_head(tmp_path / "tied", HEAD_HIDDEN)
    head_checkpoint(tmp_path / "m", ["lm_head.weight"], {}, index=True)
    with pytest.raises(LMHeadError, match=r"lm_head.weight has shape \(12, 4\), not .* hidden 8"):
        load_lm_head(tmp_path / "m", 8)
    (tmp_path / "fp8").mkdir()
    (tmp_path / "fp8" / "config.json").write_text(json.dumps({"vocab_size": HEAD_VOCAB}))
    fp8 = torch.zeros(HEAD_VOCAB, HEAD_HIDDEN).to(torch.float8_e4m3fn)
    save_file({"lm_head.weight": fp8}, tmp_path / "fp8" / "model.safetensors")
    with pytest.raises(LMHeadError, match=r"is torch\.float8_e4m3fn"):
        load_lm_head(tmp_path / "fp8", HEAD_HIDDEN)


def test_a_padded_head_is_cut_to_the_vocabulary(tmp_path: Path) -> None:
    tensors = head_checkpoint(tmp_path / "m", ["lm_head.weight"], {}, index=False)
    (tmp_path / "m" / "config.json").write_text(json.dumps({"vocab_size": HEAD_VOCAB - 2}))
    assert torch.equal(
        load_lm_head(tmp_path / "m", HEAD_HIDDEN), tensors["lm_head.weight"][: HEAD_VOCAB - 2]
    )
