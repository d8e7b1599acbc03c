"""The HF reference helper itself: its routing-tie threshold rests on measured float32 noise, it
resolves a tie that a CPU's kernels flip, and it still fails misaligned or swapped rows (the same
checks on a real store are in tests/integration/test_node_worker.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.helpers.hf_reference import (
    ROUTING_TIE,
    TOLERANCE,
    assert_matches,
    min_cosine,
    moe_routers,
    reference_model,
    reference_states,
)
from tests.helpers.jobs import DTYPE, LAYERS
from tests.helpers.prompts import chat_prompts

FLOAT32 = TOLERANCE[DTYPE]

PROMPTS = 10  # the node-worker test's prompts: one of them has a tie before the last MoE layer


def router_margins(model: torch.nn.Module, input_ids: list[int]) -> torch.Tensor:
    """[MoE layers, T]: k-th minus (k+1)-th expert choice score, computed in float64."""
    margins = []

    def record(router: torch.nn.Module, _inputs: tuple, output: tuple) -> None:
        choice = output[0].double().sigmoid() + router.e_score_correction_bias.double()
        top = torch.topk(choice, router.top_k + 1, dim=-1).values
        margins.append(top[:, -2] - top[:, -1])

    handles = [r.register_forward_hook(record) for r in moe_routers(model).values()]
    try:
        with torch.no_grad():
            model.model(torch.tensor([input_ids]))
    finally:
        for handle in handles:
            handle.remove()
    return torch.stack(margins)


def test_float32_routing_noise_is_a_tenth_of_the_tie_threshold_or_less(
    deepseek_path: Path,
) -> None:
    # float64 stands in for the exact result; another CPU's float32 kernels differ from ours
    # by about as much as ours differ from it. Measured: 7.1e-7 (AMD EPYC, AVX2).
    models = {
        dtype: AutoModelForCausalLM.from_pretrained(
            deepseek_path, dtype=dtype, experts_implementation="eager"
        ).eval()
        for dtype in (torch.float32, torch.float64)
    }
    noise = 0.0
    for ids in chat_prompts(deepseek_path, PROMPTS)[0]:
        f32, f64 = (router_margins(models[d], ids.tolist()) for d in models)
        noise = max(noise, float((f32 - f64).abs().max()))
    assert noise < ROUTING_TIE / 10, f"float32 routing noise {noise:.2e}"


def flipped_tie_case(model_path: Path) -> tuple[list[int], object, object]:
    """A prompt with a tie in a MoE layer before the last (a flip there moves later rows
    through attention), its plain reference, and the reference with that tie flipped: what a
    CPU whose kernels pick the other expert produces."""
    last_moe = max(moe_routers(reference_model(model_path)))
    for ids in chat_prompts(model_path, PROMPTS)[0]:
        plain = reference_states(model_path, ids.tolist(), LAYERS)
        early = [tie for tie in plain.ties if tie.layer < last_moe]
        if early:
            flipped = reference_states(
                model_path, ids.tolist(), LAYERS, {early[0].key: early[0].alternative}
            )
            return ids.tolist(), plain, flipped
    pytest.fail("no prompt with a routing tie before the last MoE layer: change the prompts")


def test_a_tie_flipped_by_the_cpu_is_resolved_and_misaligned_rows_still_fail(
    deepseek_path: Path,
) -> None:
    ids, plain, flipped = flipped_tie_case(deepseek_path)
    # Compared as they are, the flip fails: its own row a lot, the rows after it slightly.
    assert min_cosine(flipped.final, plain.final) < 0.999
    tie_row = next(iter(flipped.forced))[1]
    after = slice(tie_row + 1, None)
    assert min_cosine(flipped.final[after], plain.final[after]) < 0.999995

    matched = assert_matches(
        deepseek_path, ids, LAYERS, flipped.aux, flipped.final, **FLOAT32, what="flipped"
    )
    assert matched.forced == flipped.forced

    # Rows one token late (the previous row's states), or another prompt's rows.
    late_aux = torch.cat([flipped.aux[:1], flipped.aux[:-1]])
    late_final = torch.cat([flipped.final[:1], flipped.final[:-1]])
    with pytest.raises(AssertionError, match="shifted: aux differs"):
        assert_matches(deepseek_path, ids, LAYERS, late_aux, late_final, **FLOAT32, what="shifted")
    other = next(p.tolist() for p in chat_prompts(deepseek_path, PROMPTS)[0] if len(p) > len(ids))
    theirs = reference_states(deepseek_path, other[: len(ids)], LAYERS)
    with pytest.raises(AssertionError, match="swapped: aux differs"):
        assert_matches(
            deepseek_path, ids, LAYERS, theirs.aux, theirs.final, **FLOAT32, what="swapped"
        )
