"""patches/cpu_vl_ops.py: each op against its formula, through torch.ops as SGLang calls them."""

from __future__ import annotations

import pytest
import torch

import patches
from patches import cpu_vl_ops
from patches.settings import ENV_CPU_ENGINE, ENV_DUMP_DIR, ENV_MLA_CPU_FIX

OPS_NAMESPACE = "hsx_test_cpu_vl_ops"  # ours: the real sgl_kernel namespace stays untouched

DTYPES = [(torch.float32, 1e-6), (torch.bfloat16, 2e-2)]


@pytest.fixture(scope="module")
def ops() -> object:
    cpu_vl_ops.register(OPS_NAMESPACE)
    return getattr(torch.ops, OPS_NAMESPACE)


def randn(*shape: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def gemma_per_head(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The formula, restated: Gemma's RMSNorm over each head's last dim, in float32."""
    xf = x.float()
    normed = xf / torch.sqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * (1 + weight.float())
    return normed.to(x.dtype)


@pytest.mark.parametrize(("dtype", "tol"), DTYPES)
def test_sigmoid_mul_is_in_place_for_a_flat_or_strided_gate(
    ops: object, dtype: torch.dtype, tol: float
) -> None:
    t, h, d = 5, 3, 8
    x = randn(t, h * d, dtype=dtype, seed=1)
    gate = randn(t, h, 2 * d, dtype=dtype, seed=2)[..., :d]  # a strided view, as qwen3_5's
    for g in (gate, gate.reshape(t, h * d)):
        y = x.clone()
        assert ops.fused_sigmoid_mul_cpu(y, g) is None
        expected = x.float() * torch.sigmoid(g.reshape(t, -1).float())
        torch.testing.assert_close(y, expected.to(dtype), atol=tol, rtol=tol)
    with pytest.raises(RuntimeError, match="does not match"):
        ops.fused_sigmoid_mul_cpu(x.clone(), gate[:, :2])


@pytest.mark.parametrize(("dtype", "tol"), DTYPES)
def test_gemma_qk_norm_is_per_head_and_a_wrong_head_dim_differs(
    ops: object, dtype: torch.dtype, tol: float
) -> None:
    t, h, hkv, d, eps = 4, 4, 2, 8, 1e-6
    q, k = randn(t, h * d, dtype=dtype, seed=3), randn(t, hkv * d, dtype=dtype, seed=4)
    q_w, k_w = randn(d, dtype=dtype, seed=5), randn(d, dtype=dtype, seed=6)
    q_out, k_out = ops.fused_qk_gemma_rmsnorm_cpu(q, k, q_w, k_w, eps, d)
    assert q_out.shape == q.shape and k_out.shape == k.shape
    expected_q = gemma_per_head(q.view(t, h, d), q_w, eps).view(t, -1)
    torch.testing.assert_close(q_out, expected_q, atol=tol, rtol=tol)
    torch.testing.assert_close(
        k_out, gemma_per_head(k.view(t, hkv, d), k_w, eps).view(t, -1), atol=tol, rtol=tol
    )
    # The per-head grouping matters: heads of 2D normalized together are not this.
    wide_w = torch.cat([q_w, q_w])
    wide, _ = ops.fused_qk_gemma_rmsnorm_cpu(q, k, wide_w, torch.cat([k_w, k_w]), eps, 2 * d)
    assert not torch.allclose(wide.float(), expected_q.float(), atol=0.1)


@pytest.mark.parametrize(("dtype", "tol"), DTYPES)
def test_gemma_qk_norm_with_gate_norms_q_and_copies_the_gate(
    ops: object, dtype: torch.dtype, tol: float
) -> None:
    t, h, hkv, d, eps = 4, 3, 2, 8, 1e-6
    # q|gate, k, v split off one wider projection: non-contiguous rows, as qwen3_5 passes them.
    qkv = randn(t, 2 * h * d + 2 * hkv * d, dtype=dtype, seed=7)
    q_gate, k, _ = qkv.split([2 * h * d, hkv * d, hkv * d], dim=-1)
    q_w, k_w = randn(d, dtype=dtype, seed=8), randn(d, dtype=dtype, seed=9)
    q_out, k_out, gate_out = ops.fused_qk_gemma_rmsnorm_with_gate_cpu(
        q_gate, k, q_w, k_w, eps, d, h
    )
    heads = q_gate.reshape(t, h, 2 * d)
    assert q_out.shape == gate_out.shape == (t * h, d) and k_out.shape == (t * hkv, d)
    torch.testing.assert_close(
        q_out, gemma_per_head(heads[..., :d], q_w, eps).reshape(-1, d), atol=tol, rtol=tol
    )
    assert torch.equal(gate_out, heads[..., d:].reshape(-1, d))
    torch.testing.assert_close(
        k_out, gemma_per_head(k.reshape(t, hkv, d), k_w, eps).reshape(-1, d), atol=tol, rtol=tol
    )
    with pytest.raises(RuntimeError, match="expected 2 \\* 4 heads"):
        ops.fused_qk_gemma_rmsnorm_with_gate_cpu(q_gate, k, q_w, k_w, eps, d, h + 1)


def test_qkvzba_split_keeps_each_head_in_place(ops: object) -> None:
    t, nqk, nv, dqk, dv = 5, 2, 6, 4, 5  # three v heads per k head
    qkvz = randn(t, 2 * nqk * dqk + 2 * nv * dv, dtype=torch.float32, seed=10)
    ba = randn(t, 2 * nv, dtype=torch.float32, seed=11)
    qkv, z, b, a = ops.fused_qkvzba_split_reshape_cat_contiguous_cpu(qkvz, ba, nqk, nv, dqk, dv)
    # Element by element, as the Triton kernel indexes it: per k head, its q, k, v and z parts.
    q_all, v_group = nqk * dqk, nv // nqk * dv
    expected_qkv, expected_z = torch.empty_like(qkv), torch.empty(t, nv * dv)
    for i in range(nqk):
        for offset in (0, q_all):
            cols = slice(offset + i * dqk, offset + (i + 1) * dqk)
            expected_qkv[:, cols] = qkvz[:, cols]
        v = 2 * q_all + i * v_group
        expected_qkv[:, v : v + v_group] = qkvz[:, v : v + v_group]
        z_from = v + nv * dv
        expected_z[:, i * v_group : (i + 1) * v_group] = qkvz[:, z_from : z_from + v_group]
    assert torch.equal(qkv, expected_qkv)
    assert z.shape == (t, nv, dv) and torch.equal(z.reshape(t, -1), expected_z)
    assert torch.equal(b, ba[:, :nv]) and torch.equal(a, ba[:, nv:])
    with pytest.raises(RuntimeError, match="narrower than the heads"):
        ops.fused_qkvzba_split_reshape_cat_contiguous_cpu(qkvz[:, :-1], ba, nqk, nv, dqk, dv)


def test_register_is_idempotent_and_never_replaces_an_op_that_exists() -> None:
    namespace = "hsx_test_cpu_vl_ops_existing"
    existing = torch.library.Library(namespace, "FRAGMENT")
    existing.define(cpu_vl_ops.SCHEMAS["fused_sigmoid_mul_cpu"])

    def real_kernel(x: torch.Tensor, gate: torch.Tensor) -> None:  # not the formula: told apart
        x.zero_()

    existing.impl("fused_sigmoid_mul_cpu", real_kernel, "CPU")

    defined = cpu_vl_ops.register(namespace)
    assert defined == [n for n in cpu_vl_ops.SCHEMAS if n != "fused_sigmoid_mul_cpu"]
    assert cpu_vl_ops.register(namespace) == []
    ops = getattr(torch.ops, namespace)
    x = torch.ones(2, 4)
    ops.fused_sigmoid_mul_cpu(x, torch.zeros(2, 4))
    assert torch.equal(x, torch.zeros(2, 4)), "the existing op was replaced"
    q = torch.randn(2, 8)
    q_out, _ = ops.fused_qk_gemma_rmsnorm_cpu(q, q, torch.zeros(4), torch.zeros(4), 1e-6, 4)
    torch.testing.assert_close(
        q_out, gemma_per_head(q.view(2, 2, 4), torch.zeros(4), 1e-6).view(2, 8)
    )


@pytest.mark.parametrize(("cpu_engine", "calls"), [("1", 1), ("0", 0), (None, 0)])
def test_the_plugin_defines_them_on_the_cpu_engine_only(
    monkeypatch: pytest.MonkeyPatch, cpu_engine: str | None, calls: int
) -> None:
    called: list[str] = []
    monkeypatch.setattr(cpu_vl_ops, "register", lambda: called.append("register") or [])
    monkeypatch.setenv(ENV_MLA_CPU_FIX, "0")  # no hook registered into SGLang here
    monkeypatch.delenv(ENV_DUMP_DIR, raising=False)
    if cpu_engine is None:
        monkeypatch.delenv(ENV_CPU_ENGINE, raising=False)
    else:
        monkeypatch.setenv(ENV_CPU_ENGINE, cpu_engine)
    patches.register()
    assert len(called) == calls
