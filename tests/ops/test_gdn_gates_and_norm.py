"""The Gated DeltaNet layer's small ops against float64: the gates kernel (``gdn_gates_triton``) and the
gated norm's Gated DeltaNet order (``gated_rms_norm`` with `round_normed`), in the Triton interpreter
in fp32 on the CPU and in bf16 / fp16 on a GPU; the reference of that norm against the layer's own
formula as transformers writes it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from replayserve.ops.gdn_gates import gdn_gates_ref
from replayserve.ops.gdn_gates_triton import gdn_gates_triton
from replayserve.ops.norm import gated_rms_norm_ref
from replayserve.ops.norm_triton import gated_rms_norm_triton

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
DTYPES = [torch.float32] + ([torch.bfloat16, torch.float16] if CUDA else [])
F64 = torch.float64


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "heads"), [(1, 32), (7, 12), (300, 48)])
def test_gates_match_float64(dtype: torch.dtype, rows: int, heads: int) -> None:
    gen = torch.Generator().manual_seed(rows + heads)
    # a spans softplus' three regimes: far below 0 (log1p of a tiny exp), around 0, above 20
    a = (torch.randn(rows, 2 * heads, generator=gen, dtype=F64) * 12)[:, ::2]  # strided rows and heads
    b = torch.randn(rows, heads, generator=gen, dtype=F64) * 4
    a_log, dt_bias = torch.randn(heads, generator=gen, dtype=F64), torch.randn(heads, generator=gen, dtype=F64)
    a[0, 0], a[-1, -1] = 25.0, -40.0
    ins = [t.to(DEVICE, dtype) for t in (a, b, a_log, dt_bias)]
    g, beta = gdn_gates_triton(*ins)
    g64, beta64 = gdn_gates_ref(*(t.cpu().double() for t in ins))
    torch.testing.assert_close(g.cpu().double(), g64, rtol=2e-6, atol=0)
    # beta rounds through b's dtype as the reference does: within about one rounding of that dtype
    ulp = {torch.float32: 1e-6, torch.bfloat16: 8e-3, torch.float16: 1e-3}[dtype]  # fp32: a few ulps
    torch.testing.assert_close(beta.cpu().double(), gdn_gates_ref(*ins)[1].cpu().double(), rtol=ulp, atol=0)
    torch.testing.assert_close(beta.cpu().double(), beta64, rtol=2 * ulp, atol=0)


def _layer_norm_formula(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Qwen3NextRMSNormGated.forward, written out: x, z (..., V), weight (V,)."""
    dtype = x.dtype
    h = x.to(torch.float32 if dtype != F64 else F64)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    h = weight * h.to(dtype)
    return (h * F.silu(z.to(torch.float32 if dtype != F64 else F64))).to(dtype)


@pytest.mark.parametrize("dtype", [F64, torch.float32, torch.bfloat16])
def test_round_normed_reference_is_the_layers_formula(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    x, z = (torch.randn(5, 4, 16, generator=gen).to(dtype) for _ in range(2))
    weight = torch.randn(16, generator=gen).to(dtype)
    got = gated_rms_norm_ref(x.reshape(5, 64), z.reshape(5, 64), weight, 1e-6, 16, norm_before_gate=True,
                             round_normed=True)
    assert torch.equal(got.view(5, 4, 16), _layer_norm_formula(x, z, weight, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shared", [True, False], ids=["shared-weight", "full-weight"])
def test_round_normed_kernel_matches_the_reference(dtype: torch.dtype, shared: bool) -> None:
    gen = torch.Generator().manual_seed(4)
    heads, v = 6, 96  # V not a power of two: masked lanes
    x = torch.randn(9, heads * v, generator=gen).to(DEVICE, dtype)
    z = torch.randn(9, 2 * heads * v, generator=gen).to(DEVICE, dtype)[:, ::2]
    weight = torch.randn(v if shared else heads * v, generator=gen).to(DEVICE, dtype)
    got = gated_rms_norm_triton(x, z, weight, 1e-6, v, norm_before_gate=True, round_normed=True)
    want = gated_rms_norm_ref(x.cpu(), z.cpu(), weight.cpu(), 1e-6, v, norm_before_gate=True, round_normed=True)
    assert got.dtype == dtype
    tol = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(got.cpu().float(), want.float(), rtol=tol, atol=tol)


def test_round_normed_needs_norm_before_gate() -> None:
    x = torch.zeros(1, 8)
    with pytest.raises(ValueError, match="round_normed goes with norm_before_gate"):
        gated_rms_norm_ref(x, x, torch.ones(8), 1e-6, 8, round_normed=True)
