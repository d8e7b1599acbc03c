"""The independent reference: the same weights run by HF transformers, in float32."""

from __future__ import annotations

from functools import cache
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM


@cache
def _model(path: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@torch.no_grad()
def reference_states(
    model_path: Path, input_ids: list[int], layer_ids: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """(aux [T, len(layer_ids), H], final [T, H]): HF `output_hidden_states[i]` is the
    residual stream entering layer i; `last_hidden_state` is after the final norm."""
    out = _model(model_path).model(torch.tensor([input_ids]), output_hidden_states=True)
    aux = torch.stack([out.hidden_states[i][0] for i in layer_ids], dim=1)
    return aux, out.last_hidden_state[0]


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """RMS of the difference over the RMS of the reference (bf16 rounding alone: ~0.3%)."""
    actual, expected = actual.float(), expected.float()
    return float((actual - expected).pow(2).mean().sqrt() / expected.pow(2).mean().sqrt())


def min_cosine(actual: torch.Tensor, expected: torch.Tensor) -> float:
    a = actual.float().reshape(-1, actual.shape[-1])
    e = expected.float().reshape(-1, expected.shape[-1])
    return float(torch.nn.functional.cosine_similarity(a, e, dim=-1).min())
