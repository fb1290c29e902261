from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from replayserve.ops.conv1d import causal_conv1d_ref, causal_conv1d_update_ref, causal_conv1d_varlen_ref

F64 = torch.float64
TOL = 1e-10


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).abs().max() / expected.abs().max()).item()


def make_params(dim: int, width: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    weight = torch.randn(dim, width, generator=gen, dtype=F64)
    bias = torch.randn(dim, generator=gen, dtype=F64)
    return weight, bias


def torch_conv(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, state: torch.Tensor | None, silu: bool
) -> torch.Tensor:
    """Independent implementation: grouped F.conv1d over [state ; x] or zero left padding."""
    dim, width = weight.shape
    inp = x.T[None]  # (1, D, L)
    inp = F.pad(inp, (width - 1, 0)) if state is None else torch.cat([state[None], inp], dim=-1)
    out = F.conv1d(inp, weight[:, None, :], bias, groups=dim)[0].T
    return F.silu(out) if silu else out


@pytest.mark.parametrize("seqlen", [1, 3, 17])
@pytest.mark.parametrize("activation", ["silu", None])
@pytest.mark.parametrize("with_bias", [True, False])
def test_matches_torch_conv1d_from_zero_state(seqlen: int, activation: str | None, with_bias: bool) -> None:
    gen = torch.Generator().manual_seed(seqlen)
    dim, width = 12, 4
    weight, bias = make_params(dim, width, gen)
    bias = bias if with_bias else None
    x = torch.randn(seqlen, dim, generator=gen, dtype=F64)
    y, final = causal_conv1d_ref(x, weight, bias, None, activation)
    assert y.shape == (seqlen, dim) and y.dtype == F64
    assert rel_err(y, torch_conv(x, weight, bias, None, activation == "silu")) < TOL
    expected_final = torch.cat([torch.zeros(dim, width - 1, dtype=F64), x.T], dim=1)[:, -(width - 1) :]
    assert torch.equal(final, expected_final)


@pytest.mark.parametrize("seqlen", [1, 2, 9])
def test_matches_torch_conv1d_with_state(seqlen: int) -> None:
    gen = torch.Generator().manual_seed(100 + seqlen)
    dim, width = 8, 4
    weight, bias = make_params(dim, width, gen)
    x = torch.randn(seqlen, dim, generator=gen, dtype=F64)
    state = torch.randn(dim, width - 1, generator=gen, dtype=F64)
    y, final = causal_conv1d_ref(x, weight, bias, state)
    assert rel_err(y, torch_conv(x, weight, bias, state, True)) < TOL
    # For L < K-1 the final state keeps part of the incoming state.
    assert torch.equal(final, torch.cat([state, x.T], dim=1)[:, -(width - 1) :])


@pytest.mark.parametrize("prefix", [0, 1, 2, 7])
def test_prefill_then_decode_and_chunked_prefill(prefix: int) -> None:
    gen = torch.Generator().manual_seed(200 + prefix)
    dim, width, seqlen, slots = 10, 4, 13, 5
    weight, bias = make_params(dim, width, gen)
    xs = [torch.randn(seqlen, dim, generator=gen, dtype=F64) for _ in range(2)]
    full = [causal_conv1d_ref(x, weight, bias) for x in xs]

    # Chunked prefill: two calls chained through final_state.
    for x, (y_full, s_full) in zip(xs, full, strict=True):
        y1, s1 = causal_conv1d_ref(x[:prefix], weight, bias)
        y2, s2 = causal_conv1d_ref(x[prefix:], weight, bias, s1)
        assert rel_err(torch.cat([y1, y2]), y_full) < TOL
        assert torch.equal(s2, s_full)

    # Decode the two sequences as one batch living in slots 3 and 1 of a pool.
    pool = torch.randn(slots, dim, width - 1, generator=gen, dtype=F64)
    original = pool.clone()
    idx = torch.tensor([3, 1])
    ys: list[list[torch.Tensor]] = [[], []]
    for b, x in enumerate(xs):
        y_pre, pool[idx[b]] = causal_conv1d_ref(x[:prefix], weight, bias)
        ys[b].append(y_pre)
    for t in range(prefix, seqlen):
        step = torch.stack([xs[0][t], xs[1][t]])
        y = causal_conv1d_update_ref(step, pool, weight, bias, idx)
        for b in range(2):
            ys[b].append(y[b : b + 1])
    for b, (y_full, s_full) in enumerate(full):
        assert rel_err(torch.cat(ys[b]), y_full) < TOL
        assert torch.equal(pool[idx[b]], s_full)
    untouched = [i for i in range(slots) if i not in idx.tolist()]
    assert torch.equal(pool[untouched], original[untouched])


def test_update_is_bitwise_equal_without_activation() -> None:
    # Without the activation both paths are pure mul/add in the same order.
    gen = torch.Generator().manual_seed(7)
    dim, width = 16, 4
    weight, bias = make_params(dim, width, gen)
    x = torch.randn(6, dim, generator=gen, dtype=F64)
    y_ref, _ = causal_conv1d_ref(x, weight, bias, activation=None)
    pool = torch.zeros(2, dim, width - 1, dtype=F64)
    idx = torch.tensor([1])
    ys = [causal_conv1d_update_ref(x[t : t + 1], pool, weight, bias, idx, activation=None) for t in range(6)]
    assert torch.equal(torch.cat(ys), y_ref)


def test_low_precision_dtypes() -> None:
    gen = torch.Generator().manual_seed(8)
    dim, width = 16, 4
    weight, bias = make_params(dim, width, gen)
    x = torch.randn(9, dim, generator=gen, dtype=F64)
    expected = torch_conv(x, weight, bias, None, True)
    y, final = causal_conv1d_ref(x.bfloat16(), weight.bfloat16(), bias.bfloat16())
    assert y.dtype == torch.bfloat16 and final.dtype == torch.bfloat16
    assert rel_err(y.double(), expected) < 3e-2


def test_rejects_unknown_activation() -> None:
    with pytest.raises(ValueError):
        causal_conv1d_ref(torch.ones(2, 3), torch.ones(3, 4), None, activation="gelu")


def test_varlen_is_each_sequence_from_its_slot() -> None:
    """Packed sequences (one empty, one shorter than K-1) against grouped F.conv1d over [slot state ; x]."""
    gen = torch.Generator().manual_seed(7)
    dim, width, lens, slots = 8, 4, [5, 0, 2, 11], [3, 1, 0, 4]
    weight, bias = make_params(dim, width, gen)
    pool = torch.randn(6, dim, width - 1, generator=gen, dtype=F64)
    before = pool.clone()
    x = torch.randn(sum(lens), dim, generator=gen, dtype=F64)
    cu = torch.tensor([0, 5, 5, 7, 18])
    y = causal_conv1d_varlen_ref(x, weight, bias, pool, torch.tensor(slots), cu)
    for s, slot in enumerate(slots):
        xs = x[cu[s] : cu[s + 1]]
        if xs.shape[0]:
            assert rel_err(y[cu[s] : cu[s + 1]], torch_conv(xs, weight, bias, before[slot], True)) < TOL
        assert torch.equal(pool[slot], torch.cat([before[slot], xs.T], dim=1)[:, -(width - 1) :])
    assert torch.equal(pool[[2, 5]], before[[2, 5]])
