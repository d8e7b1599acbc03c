"""Why a store keeps both final states rather than derive the post-norm one from the pre-norm.

`python -m tools.prenorm_derivation` runs SGLang's own RMSNorm (`forward_native`, its CPU path)
as a model's final norm does: on the last layer's output plus its residual, normalizing the
float32 sum. The pre-norm state a dump holds is that sum rounded to bf16, so the norm applied
to it at read time is not the norm the model applied: it prints how far the derived post-norm
state is from the model's own (SGLang's fused CUDA kernel also normalizes the unrounded sum).
Measured here: ~22% of the bf16 values differ, by up to 1 ulp, in every row.
"""

from __future__ import annotations

import torch
from sglang.srt.layers.layernorm import RMSNorm

ROWS = 4096


def compare(hidden: int) -> str:
    norm = RMSNorm(hidden, eps=1e-6)
    norm.weight.data = 1 + 0.1 * torch.randn(hidden)
    x = (torch.randn(ROWS, hidden) * 2).bfloat16()  # the last layer's output
    residual = (torch.randn(ROWS, hidden) * 8).bfloat16()  # the residual stream entering it
    model, prenorm = norm.forward_native(x, residual)  # the lm_head's input; the bf16 sum
    derived = norm.forward_native(prenorm.clone())
    model, derived = model.bfloat16(), derived.bfloat16()
    differ = model.view(torch.int16) != derived.view(torch.int16)
    ulp = (model.float() - derived.float()).abs() / model.float().abs().clamp_min(1e-30) * 128
    cos = torch.nn.functional.cosine_similarity(model.float(), derived.float(), dim=-1)
    return (
        f"hidden {hidden}: {differ.float().mean():.2%} of bf16 values differ (max "
        f"{ulp.max():.2f} ulp), in {differ.any(1).float().mean():.0%} of rows; "
        f"min cosine 1 - {1 - cos.min():.1e}"
    )


def main() -> None:
    torch.manual_seed(0)
    for hidden in (512, 7168):
        print(compare(hidden))


if __name__ == "__main__":
    main()
