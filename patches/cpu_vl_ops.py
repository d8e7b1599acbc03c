"""Pure-torch CPU versions of four `torch.ops.sgl_kernel` ops that SGLang 0.5.23 binds at import
time on CPU (`sglang/srt/models/qwen3_5.py`'s `if _is_cpu:` block).

Without them `import sglang.srt.models.qwen3_5` fails wherever sgl_kernel is our import-only
shim, and with it `multimodal/processors/qwen_vl.py`, which imports qwen3_5: no Qwen-VL model
then gets a multimodal processor ("No processor registered for architecture:
Qwen2_5_VLForConditionalGeneration") and image requests are refused. Qwen2.5-VL never calls
these ops; only Qwen3.5 (and muse_glimmer) do.

Schemas are sgl-kernel's CPU extension's (csrc/cpu/torch_extension_cpu.cpp) for the version
0.5.23 calls; semantics follow the Triton kernels of the same names: norms in float32 with
Gemma's (1 + w) weight, results cast back. Unlike the C++ kernels (bf16/fp16 only) these also
take float32. Design: docs/design/capture-plugin.md.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

NAMESPACE = "sgl_kernel"

SCHEMAS = {
    "fused_sigmoid_mul_cpu": "fused_sigmoid_mul_cpu(Tensor(a!) input, Tensor gate) -> ()",
    "fused_qk_gemma_rmsnorm_cpu": (
        "fused_qk_gemma_rmsnorm_cpu(Tensor q, Tensor k, Tensor q_weight, Tensor k_weight, "
        "float eps, int head_dim) -> (Tensor, Tensor)"
    ),
    "fused_qk_gemma_rmsnorm_with_gate_cpu": (
        "fused_qk_gemma_rmsnorm_with_gate_cpu(Tensor q_gate, Tensor k, Tensor q_weight, "
        "Tensor k_weight, float eps, int head_dim, int num_head) -> (Tensor, Tensor, Tensor)"
    ),
    "fused_qkvzba_split_reshape_cat_contiguous_cpu": (
        "fused_qkvzba_split_reshape_cat_contiguous_cpu(Tensor mixed_qkvz, Tensor mixed_ba, "
        "int num_heads_qk, int num_heads_v, int head_qk, int head_v) "
        "-> (Tensor, Tensor, Tensor, Tensor)"
    ),
}

# Kept alive for the process: a Library dropped unregisters what it defined.
_libraries: dict[str, torch.library.Library] = {}


def gemma_rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., D] * rsqrt(mean(x^2) + eps) * (1 + w), in float32, cast back to x's dtype."""
    xf = x.float()
    variance = xf.pow(2).mean(dim=-1, keepdim=True)
    return (xf * torch.rsqrt(variance + eps) * (1.0 + weight.float())).to(x.dtype)


def fused_sigmoid_mul_cpu(input: torch.Tensor, gate: torch.Tensor) -> None:
    """In place: input [T, H*D] *= sigmoid(gate); gate [T, H*D] or a strided [T, H, D] view."""
    if input.dim() != 2 or gate.dim() not in (2, 3):
        raise RuntimeError(
            f"fused_sigmoid_mul_cpu: input must be 2D and gate 2D or 3D, got "
            f"{tuple(input.shape)} and {tuple(gate.shape)}"
        )
    flat_gate = gate.reshape(input.shape[0], -1)
    if flat_gate.shape != input.shape:
        raise RuntimeError(
            f"fused_sigmoid_mul_cpu: gate {tuple(gate.shape)} does not match {tuple(input.shape)}"
        )
    input.copy_((input.float() * torch.sigmoid(flat_gate.float())).to(input.dtype))


def fused_qk_gemma_rmsnorm_cpu(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    head_dim: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head Gemma RMSNorm of q [T, H*D] and k [T, Hkv*D]; outputs shaped like the inputs."""
    q_out = gemma_rmsnorm(q.reshape(q.shape[0], -1, head_dim), q_weight, eps)
    k_out = gemma_rmsnorm(k.reshape(k.shape[0], -1, head_dim), k_weight, eps)
    return q_out.reshape(q.shape).contiguous(), k_out.reshape(k.shape).contiguous()


def fused_qk_gemma_rmsnorm_with_gate_cpu(
    q_gate: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    head_dim: int,
    num_head: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q_gate [T, H*2D], each head laid out as [q_h | gate_h], and k [T, Hkv*D] ->
    q [T*H, D] (normed), k [T*Hkv, D] (normed), gate [T*H, D] (copied as is)."""
    rows = q_gate.shape[0]
    if q_gate.shape[1] != 2 * num_head * head_dim:
        raise RuntimeError(
            f"fused_qk_gemma_rmsnorm_with_gate_cpu: q_gate has {q_gate.shape[1]} columns, "
            f"expected 2 * {num_head} heads * {head_dim}"
        )
    heads = q_gate.reshape(rows, num_head, 2 * head_dim)
    q_out = gemma_rmsnorm(heads[..., :head_dim], q_weight, eps).reshape(-1, head_dim)
    gate_out = heads[..., head_dim:].reshape(-1, head_dim).clone()
    k_out = gemma_rmsnorm(k.reshape(rows, -1, head_dim), k_weight, eps).reshape(-1, head_dim)
    return q_out.contiguous(), k_out.contiguous(), gate_out.contiguous()


def fused_qkvzba_split_reshape_cat_contiguous_cpu(
    mixed_qkvz: torch.Tensor,
    mixed_ba: torch.Tensor,
    num_heads_qk: int,
    num_heads_v: int,
    head_qk: int,
    head_v: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """mixed_qkvz [B, q | k | v | z], mixed_ba [B, b | a] -> qkv [B, q | k | v],
    z [B, Hv, Dv], b [B, Hv], a [B, Hv]. The contiguous layout keeps every head in place,
    so this is slicing and copies."""
    batch = mixed_qkvz.shape[0]
    qkv_dim = 2 * num_heads_qk * head_qk + num_heads_v * head_v
    z_dim = num_heads_v * head_v
    if mixed_qkvz.shape[1] < qkv_dim + z_dim or mixed_ba.shape[1] < 2 * num_heads_v:
        raise RuntimeError(
            f"fused_qkvzba_split_reshape_cat_contiguous_cpu: inputs {tuple(mixed_qkvz.shape)} "
            f"and {tuple(mixed_ba.shape)} are narrower than the heads given"
        )
    qkv = mixed_qkvz[:, :qkv_dim].contiguous()
    z = mixed_qkvz[:, qkv_dim : qkv_dim + z_dim].reshape(batch, num_heads_v, head_v).contiguous()
    b = mixed_ba[:, :num_heads_v].contiguous()
    a = mixed_ba[:, num_heads_v : 2 * num_heads_v].contiguous()
    return qkv, z, b, a


IMPLEMENTATIONS: dict[str, Callable[..., object]] = {
    "fused_sigmoid_mul_cpu": fused_sigmoid_mul_cpu,
    "fused_qk_gemma_rmsnorm_cpu": fused_qk_gemma_rmsnorm_cpu,
    "fused_qk_gemma_rmsnorm_with_gate_cpu": fused_qk_gemma_rmsnorm_with_gate_cpu,
    "fused_qkvzba_split_reshape_cat_contiguous_cpu": fused_qkvzba_split_reshape_cat_contiguous_cpu,
}


def _exists(namespace: str, name: str) -> bool:
    try:
        getattr(getattr(torch.ops, namespace), name)
    except (AttributeError, RuntimeError):
        return False
    return True


def register(namespace: str = NAMESPACE) -> list[str]:
    """Define the ops missing from `namespace`; returns the names this call defined. An op that
    exists (a real sgl_kernel CPU build's, or ours from an earlier call) is left alone."""
    missing = [name for name in SCHEMAS if not _exists(namespace, name)]
    if missing and namespace not in _libraries:
        _libraries[namespace] = torch.library.Library(namespace, "FRAGMENT")
    for name in missing:
        _libraries[namespace].define(SCHEMAS[name])
        _libraries[namespace].impl(name, IMPLEMENTATIONS[name], "CPU")
    return missing
