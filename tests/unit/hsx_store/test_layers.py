"""Layer ids per model family: what SGLang is asked for resolves to the HF hidden_states
indices the store records, and back, at any count."""

from __future__ import annotations

import pytest

from hsx_store.layers import requested_layer_ids, resolve_layer_ids


@pytest.mark.parametrize(
    "arch,asked,layers",
    [
        ("LlamaForCausalLM", [0], [1]),
        ("LlamaForCausalLM", [59, 0, 14, 29, 44], [1, 15, 30, 45, 60]),  # the edges 0 and L-2
        ("LlamaForCausalLM", list(range(0, 57, 8)), list(range(1, 58, 8))),
        ("DeepseekV3ForCausalLM", [0], [0]),
        ("DeepseekV3ForCausalLM", [60, 0, 15, 30, 45], [0, 15, 30, 45, 60]),  # 0 and L-1
        ("DeepseekV3ForCausalLM", [1, 2, 10, 20, 30], [2, 3, 11, 21, 31]),  # a first 1: all + 1
        ("DeepseekV3ForCausalLM", [2, 1, 10, 20, 30], [1, 2, 10, 20, 30]),  # 1 not first: as given
        ("KimiK25ForConditionalGeneration", list(range(1, 60, 8)), list(range(2, 61, 8))),
    ],
)
def test_any_number_of_ids_resolves_and_asks_back(
    arch: str, asked: list[int], layers: list[int]
) -> None:
    config = {"architectures": [arch], "num_hidden_layers": 61, "hidden_size": 8}
    assert resolve_layer_ids(config, asked) == layers
    again = requested_layer_ids(config, layers)  # what `verify --recompute` asks a server for
    assert resolve_layer_ids(config, again) == layers


@pytest.mark.parametrize(
    "arch,layers",
    [
        ("DeepseekV3ForCausalLM", [0, 1, 3]),
        ("DeepseekV3ForCausalLM", [1, 3, 5]),  # asked as [3, 5, 1]: a first 1 would shift all
        ("DeepseekV3ForCausalLM", [2, 4, 5]),
        ("KimiK25ForConditionalGeneration", [1, 30, 58]),
        ("LlamaForCausalLM", [1, 4, 7]),
        ("LlamaForCausalLM", [2, 4, 5]),
    ],
)
def test_requested_layer_ids_resolve_back_to_the_stored_ones(arch: str, layers: list[int]) -> None:
    config = {"architectures": [arch], "num_hidden_layers": 61, "hidden_size": 8}
    requested = requested_layer_ids(config, layers)
    assert resolve_layer_ids(config, requested) == layers
    if arch.startswith("Llama"):
        assert requested == [i - 1 for i in layers]


def test_layer_ids_sglang_cannot_be_asked_for_are_refused() -> None:
    llama = {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 8, "hidden_size": 8}
    deepseek = {**llama, "architectures": ["DeepseekV3ForCausalLM"]}
    with pytest.raises(ValueError, match="no --return-aux-hidden-state-layer-ids"):
        requested_layer_ids(llama, [0, 2, 4])  # the embeddings: Llama would need -1
    with pytest.raises(ValueError, match="no --return-aux-hidden-state-layer-ids"):
        requested_layer_ids(deepseek, [1])  # [1] means [2] to DeepSeek
