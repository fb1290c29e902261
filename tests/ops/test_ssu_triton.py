"""Triton baseline decode step against the float64 ``selective_state_update_ref``."""

from __future__ import annotations

import math

import pytest
import torch

from replayserve.ops.ssu import selective_state_update_ref
from replayserve.ops.ssu_triton import selective_state_update_triton

F64 = torch.float64
CUDA = torch.cuda.is_available()
DEVICES = ["cuda"] if CUDA else ["cpu"]
SMALL, BIG = (8, 16, 16, 2), (128, 64, 128, 8)  # (H, P, N, G)
TOL = {torch.float32: (1e-4, 1e-3), torch.bfloat16: (6e-2, 2e-1)}  # (rtol, atol) against float64
CASES = [pytest.param(SMALL, torch.float32, id="small-f32")]
if CUDA:
    CASES += [pytest.param(SMALL, torch.bfloat16, id="small-bf16"), pytest.param(BIG, torch.float32, id="big-f32"),
              pytest.param(BIG, torch.bfloat16, id="big-bf16")]


def _run(device: str, shape: tuple[int, int, int, int], act: torch.dtype, *, optional: bool, padded: bool,
         strided: bool, dt_limit: tuple[float, float], steps: int = 3, seed: int = 0) -> None:
    nheads, headdim, dstate, ngroups = shape
    gen = torch.Generator().manual_seed(seed)

    def randn(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=gen).to(device)

    pool, batch = 6, 4
    if strided:  # the pool as a view into a larger (layers, S, H, P, N) buffer
        state = randn(2, pool, nheads, headdim, dstate)[1]
    else:
        state = randn(pool, nheads, headdim, dstate)
    A = -torch.exp(randn(nheads) * 0.5)
    D, dt_bias = (randn(nheads), randn(nheads) * 0.5) if optional else (None, None)
    perm = torch.randperm(pool, generator=gen)[:batch]
    if padded:
        perm[1] = -1
    indices = perm.to(device) if padded or batch != pool else None
    real = (perm >= 0).to(device)
    ref_state = state.double()
    for _ in range(steps):
        x = randn(batch, nheads, headdim).to(act)
        dt = randn(batch, nheads).to(act)
        B, C = randn(batch, ngroups, dstate).to(act), randn(batch, ngroups, dstate).to(act)
        unused = [s for s in range(pool) if s not in perm.tolist()]
        before = state[unused].clone()
        y = selective_state_update_triton(state, x, dt, A, B, C, D, dt_bias, True, dt_limit, indices)
        y_ref = selective_state_update_ref(
            ref_state, x[real].double(), dt[real].double(), A.double(), B[real].double(), C[real].double(),
            None if D is None else D.double(), None if dt_bias is None else dt_bias.double(), True, dt_limit,
            perm[perm >= 0].to(device))
        rtol, atol = TOL[act]
        assert y.dtype == act
        torch.testing.assert_close(y[real].double(), y_ref, rtol=rtol, atol=atol)
        torch.testing.assert_close(state.double(), ref_state, rtol=rtol, atol=atol)
        assert not y[~real].any(), "padded rows output zeros"
        assert torch.equal(state[unused], before), "slots outside the batch are untouched"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("shape", "act"), CASES)
def test_ssu_matches_reference(device: str, shape: tuple[int, int, int, int], act: torch.dtype) -> None:
    _run(device, shape, act, optional=True, padded=True, strided=False, dt_limit=(0.0, math.inf))


@pytest.mark.parametrize("device", DEVICES)
def test_ssu_variants(device: str) -> None:
    """No D / dt_bias, a finite dt clamp, a strided pool view, and state_indices=None (S == B)."""
    _run(device, SMALL, torch.float32, optional=False, padded=True, strided=True, dt_limit=(0.1, 1.0), seed=1)
    nheads, headdim, dstate, ngroups = SMALL
    gen = torch.Generator().manual_seed(2)
    state = torch.randn(3, nheads, headdim, dstate, generator=gen).to(device)
    x = torch.randn(3, nheads, headdim, generator=gen).to(device)
    dt = torch.randn(3, nheads, generator=gen).to(device)
    A = -torch.rand(nheads, generator=gen).to(device) - 0.1
    B, C = (torch.randn(3, ngroups, dstate, generator=gen).to(device) for _ in range(2))
    ref_state = state.double()
    y = selective_state_update_triton(state, x, dt, A, B, C)
    y_ref = selective_state_update_ref(ref_state, x.double(), dt.double(), A.double(), B.double(), C.double())
    torch.testing.assert_close(y.double(), y_ref, rtol=1e-4, atol=1e-3)
    torch.testing.assert_close(state.double(), ref_state, rtol=1e-4, atol=1e-3)
