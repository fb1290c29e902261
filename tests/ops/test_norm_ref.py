from __future__ import annotations

import math

import pytest
import torch

from replayserve.ops.norm import gated_rms_norm_ref, rms_norm_ref

F64 = torch.float64
TOL = 1e-10
EPS = 1e-5


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).abs().max() / expected.abs().max()).item()


def randn(gen: torch.Generator, *size: int) -> torch.Tensor:
    return torch.randn(*size, generator=gen, dtype=F64)


def test_rms_norm_matches_formula() -> None:
    gen = torch.Generator().manual_seed(0)
    x, w = randn(gen, 3, 5, 64), randn(gen, 64)
    expected = torch.empty_like(x)
    for idx in torch.cartesian_prod(torch.arange(3), torch.arange(5)).tolist():
        row = x[idx[0], idx[1]]
        expected[idx[0], idx[1]] = row / math.sqrt(float((row * row).sum()) / 64 + EPS) * w
    out = rms_norm_ref(x, w, EPS)
    assert out.dtype == F64
    assert rel_err(out, expected) < TOL


def test_rms_norm_low_precision_casts_once() -> None:
    gen = torch.Generator().manual_seed(1)
    x, w = randn(gen, 4, 32).bfloat16(), randn(gen, 32).bfloat16()
    out = rms_norm_ref(x, w, EPS)
    xf = x.float()
    expected = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS) * w.float()).bfloat16()
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


@pytest.mark.parametrize("group_size", [8, 16, 64])
def test_gated_rms_norm_matches_formula(group_size: int) -> None:
    gen = torch.Generator().manual_seed(group_size)
    dim = 64
    x, z, w = randn(gen, 6, dim), randn(gen, 6, dim), randn(gen, dim)
    expected = torch.empty_like(x)
    for r in range(6):
        for g0 in range(0, dim, group_size):
            sl = slice(g0, g0 + group_size)
            h = x[r, sl] * z[r, sl] / (1 + torch.exp(-z[r, sl]))
            expected[r, sl] = w[sl] * h / math.sqrt(float((h * h).sum()) / group_size + EPS)
    out = gated_rms_norm_ref(x, z, w, EPS, group_size)
    assert out.dtype == F64
    assert rel_err(out, expected) < TOL


def test_gated_rms_norm_groups_are_independent() -> None:
    gen = torch.Generator().manual_seed(3)
    x, z, w = randn(gen, 2, 32), randn(gen, 2, 32), randn(gen, 32)
    base = gated_rms_norm_ref(x, z, w, EPS, 16)
    # Scaling alone is invisible to an RMS norm, so perturb the second group randomly.
    x2 = x.clone()
    x2[:, 16:] += randn(gen, 2, 16)
    moved = gated_rms_norm_ref(x2, z, w, EPS, 16)
    torch.testing.assert_close(moved[:, :16], base[:, :16], rtol=0, atol=0)
    assert rel_err(moved[:, 16:], base[:, 16:]) > 1e-3


def test_gated_rms_norm_low_precision_casts_before_weight() -> None:
    gen = torch.Generator().manual_seed(4)
    x, z, w = randn(gen, 3, 32).bfloat16(), randn(gen, 3, 32).bfloat16(), randn(gen, 32).bfloat16()
    h = x.float() * torch.nn.functional.silu(z.float())
    hg = h.view(3, 4, 8)
    hg = hg * torch.rsqrt(hg.pow(2).mean(-1, keepdim=True) + EPS)
    expected = w * hg.view(3, 32).bfloat16()
    out = gated_rms_norm_ref(x, z, w, EPS, 8)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


def test_gated_rms_norm_rejects_bad_group() -> None:
    with pytest.raises(ValueError):
        gated_rms_norm_ref(torch.ones(2, 10), torch.ones(2, 10), torch.ones(10), EPS, 4)
