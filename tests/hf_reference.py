"""The independent reference: the same weights run by HF transformers, in float32."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

# An MoE token whose k-th and (k+1)-th expert scores are closer than this is a routing tie:
# two correct implementations may pick different experts for it (seen in float32 at a 1e-6
# gap), so its rows are not compared value by value.
ROUTING_TIE = 1e-5


@dataclass(frozen=True)
class Reference:
    aux: torch.Tensor  # [T, n_layers, H]: HF output_hidden_states[i] for each requested i
    final: torch.Tensor  # [T, H]: last_hidden_state, after the final norm
    routing_ties: frozenset[int]  # rows with a routing tie in some MoE layer

    def comparable_rows(self) -> torch.Tensor:
        keep = torch.ones(len(self.final), dtype=torch.bool)
        keep[list(self.routing_ties)] = False
        return keep


@cache
def _model(path: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@torch.no_grad()
def reference_states(model_path: Path, input_ids: list[int], layer_ids: list[int]) -> Reference:
    """HF `output_hidden_states[i]` is the residual stream entering layer i."""
    model = _model(model_path)
    margins: list[torch.Tensor] = []

    def record_margin(router: torch.nn.Module, inputs: tuple, _output: object) -> None:
        x = inputs[0].reshape(-1, router.weight.shape[1])
        scores = torch.sigmoid(torch.nn.functional.linear(x.float(), router.weight.float()))
        choice = scores + getattr(router, "e_score_correction_bias", 0)
        top = torch.topk(choice, router.top_k + 1, dim=-1).values
        margins.append(top[:, -2] - top[:, -1])

    routers = [m for m in model.modules() if type(m).__name__.endswith("TopkRouter")]
    handles = [r.register_forward_hook(record_margin) for r in routers]
    try:
        out = model.model(torch.tensor([input_ids]), output_hidden_states=True)
    finally:
        for handle in handles:
            handle.remove()
    ties = (
        (torch.stack(margins).min(dim=0).values < ROUTING_TIE).nonzero().flatten().tolist()
        if margins
        else []
    )
    aux = torch.stack([out.hidden_states[i][0] for i in layer_ids], dim=1)
    return Reference(aux, out.last_hidden_state[0], frozenset(ties))


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """RMS of the difference over the RMS of the reference (bf16 rounding alone: ~0.3%)."""
    actual, expected = actual.float(), expected.float()
    return float((actual - expected).pow(2).mean().sqrt() / expected.pow(2).mean().sqrt())


def min_cosine(actual: torch.Tensor, expected: torch.Tensor) -> float:
    a = actual.float().reshape(-1, actual.shape[-1])
    e = expected.float().reshape(-1, expected.shape[-1])
    return float(torch.nn.functional.cosine_similarity(a, e, dim=-1).min())


def assert_matches(
    reference: Reference,
    aux: torch.Tensor,
    final: torch.Tensor,
    *,
    min_cos: float,
    max_error: float,
    what: str,
) -> None:
    """Every comparable row close to the reference; routing ties are few (a flipped expert
    changes its own row a lot, later rows through attention only slightly) and named."""
    keep = reference.comparable_rows()
    assert len(reference.routing_ties) <= max(2, len(keep) // 20), (
        f"{what}: {len(reference.routing_ties)} routing ties in {len(keep)} rows: "
        "the tiny model routes too close to call"
    )
    for name, actual, expected in (("aux", aux, reference.aux), ("final", final, reference.final)):
        assert min_cosine(actual[keep], expected[keep]) >= min_cos, f"{what}: {name} differs"
        assert relative_error(actual[keep], expected[keep]) <= max_error, f"{what}: {name}"
