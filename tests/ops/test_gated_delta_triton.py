"""Triton gated delta decode and verify steps against the float64 references."""

from __future__ import annotations

import pytest
import torch

from replayserve.ops.gated_delta import gated_delta_recurrent_ref, gated_delta_step_ref, gated_delta_verify_ref
from replayserve.ops.gated_delta_triton import gated_delta_step_triton, gated_delta_verify_triton

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
TOL = {torch.float32: (1e-4, 1e-4), torch.bfloat16: (3e-2, 3e-2)}  # (rtol, atol) against float64
SHAPES = [pytest.param((2, 4, 16, 32), id="hk2-hv4-k16-v32"), pytest.param((1, 2, 32, 16), id="hk1-hv2-k32-v16"),
          pytest.param((1, 1, 128, 128), id="k128-v128")]  # (Hk, Hv, K, V)
DTYPES = [torch.float32] + ([torch.bfloat16] if CUDA else [])


def _tokens(gen, batch, tokens, hk, hv, dk, dv, act):
    def randn(*size):
        return torch.randn(*size, generator=gen).to(DEVICE)

    q, k = randn(batch, tokens, hk, dk).to(act), randn(batch, tokens, hk, dk).to(act)
    v = randn(batch, tokens, hv, dv).to(act)
    g = -torch.rand(batch, tokens, hv, generator=gen).to(DEVICE)
    beta = torch.rand(batch, tokens, hv, generator=gen).to(DEVICE)
    return q, k, v, g, beta


@pytest.mark.parametrize("act", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("padded", [False, True])
def test_step_updates_the_pool_in_place(shape, act, padded):
    hk, hv, dk, dv = shape
    gen = torch.Generator().manual_seed(0)
    pool, batch = 6, 4
    state = (torch.randn(2, pool, hv, dk, dv, generator=gen) * 0.3).to(DEVICE)[1]  # a strided view of a bigger buffer
    perm = torch.randperm(pool, generator=gen)[:batch]
    if padded:
        perm[1] = -1
    real = perm >= 0
    ref_state = state.double()
    for _ in range(3):
        q, k, v, g, beta = (x[:, 0] for x in _tokens(gen, batch, 1, hk, hv, dk, dv, act))
        untouched = [s for s in range(pool) if s not in perm.tolist()]
        before = state[untouched].clone()
        o = gated_delta_step_triton(state, q, k, v, g, beta, perm.to(DEVICE), use_qk_l2norm=True)
        o_ref = gated_delta_step_ref(ref_state, *(x[real].double() for x in (q, k, v, g, beta)),
                                     perm[real].to(DEVICE), use_qk_l2norm=True)
        rtol, atol = TOL[act]
        assert o.dtype == act
        torch.testing.assert_close(o[real].double(), o_ref, rtol=rtol, atol=atol)
        torch.testing.assert_close(state.double(), ref_state, rtol=rtol, atol=atol)
        assert torch.equal(state[untouched], before)
        assert not o[~real].any(), "padded rows output zeros"


def test_step_without_indices_and_without_l2norm_is_the_recurrence():
    gen = torch.Generator().manual_seed(1)
    q, k, v, g, beta = (x[:, 0] for x in _tokens(gen, 3, 1, 2, 4, 16, 16, torch.float32))
    state = torch.randn(3, 4, 16, 16, generator=gen).to(DEVICE)
    expect_o, expect_s = gated_delta_recurrent_ref(*(x[:, None].double() for x in (q, k, v, g, beta)), state.double(),
                                                   scale=0.5)
    o = gated_delta_step_triton(state, q, k, v, g, beta, scale=0.5)
    torch.testing.assert_close(o.double(), expect_o[:, 0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(state.double(), expect_s, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("shape", SHAPES[:2])
def test_verify_keeps_every_state_and_leaves_the_pool(shape):
    hk, hv, dk, dv = shape
    gen = torch.Generator().manual_seed(2)
    state = torch.randn(5, hv, dk, dv, generator=gen).to(DEVICE) * 0.3
    slots = torch.tensor([3, -1, 0]).to(DEVICE)
    q, k, v, g, beta = _tokens(gen, 3, 4, hk, hv, dk, dv, torch.float32)
    before = state.clone()
    out = torch.full((3, 4, hv, dk, dv), 7.0, device=DEVICE)
    o = gated_delta_verify_triton(state, q, k, v, g, beta, slots, out, use_qk_l2norm=True)
    out_ref = torch.full((3, 4, hv, dk, dv), 7.0, dtype=torch.float64, device=DEVICE)
    o_ref = gated_delta_verify_ref(state.double(), *(x.double() for x in (q, k, v, g, beta)), slots, out_ref,
                                   use_qk_l2norm=True)
    assert torch.equal(state, before)
    torch.testing.assert_close(o.double(), o_ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out.double(), out_ref, rtol=1e-4, atol=1e-4)
    assert (out[1] == 7.0).all() and not o[1].any(), "a padded row writes no state and outputs zeros"
    # The reference itself is the recurrence from the pool's row.
    o_rec, s_rec = gated_delta_recurrent_ref(*(x[2:].double() for x in (q, k, v, g, beta)), state[0:1].double(),
                                             use_qk_l2norm=True)
    torch.testing.assert_close(o_ref[2:], o_rec, rtol=0, atol=1e-12)
    torch.testing.assert_close(out_ref[2, -1], s_rec[0], rtol=0, atol=1e-12)


def test_entry_points_take_the_kernel_under_force_triton():
    from replayserve.ops.dispatch import force_triton
    from replayserve.ops.gated_delta import gated_delta_step, gated_delta_verify

    gen = torch.Generator().manual_seed(3)
    q, k, v, g, beta = _tokens(gen, 2, 2, 1, 2, 16, 16, torch.float32)
    state = torch.randn(2, 2, 16, 16, generator=gen).to(DEVICE)
    ref_state = state.clone()
    with force_triton():
        o = gated_delta_verify(state, q, k, v, g, beta)
        o1 = gated_delta_step(state, *(x[:, 0] for x in (q, k, v, g, beta)))
    torch.testing.assert_close(o, gated_delta_verify_ref(ref_state, q, k, v, g, beta), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(o1, gated_delta_step_ref(ref_state, *(x[:, 0] for x in (q, k, v, g, beta))),
                               rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state, ref_state, rtol=1e-5, atol=1e-5)
