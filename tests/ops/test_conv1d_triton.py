"""Triton conv1d decode and verify steps against ``causal_conv1d_update_ref`` / ``causal_conv1d_verify_ref``.

Rows come in shuffled slot order with padded rows (state index -1), whose outputs must be zero and
which must touch no slot; slots outside the batch must stay bitwise unchanged.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from replayserve.ops.conv1d import causal_conv1d_update_ref, causal_conv1d_verify_ref
from replayserve.ops.conv1d_triton import causal_conv1d_update_triton, causal_conv1d_verify_triton

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
cuda_only = pytest.mark.skipif(not CUDA, reason="needs CUDA")
TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 2e-2), torch.float16: (4e-3, 4e-3)}  # (rtol, atol)
POOL, BATCH = 7, 5
# (D, K, bias, activation): a non-power-of-two width, several channel blocks, K from 2 to 4.
SHAPES = [(40, 4, True, "silu"), (300, 4, False, "silu"), (24, 3, True, None), (8, 2, True, "silu")]
CASES = [pytest.param(*s, torch.float32, id=f"D{s[0]}-K{s[1]}-f32") for s in SHAPES]
if CUDA:
    CASES += [pytest.param(*s, dt, id=f"D{s[0]}-K{s[1]}-{str(dt)[6:]}")
              for s in SHAPES[:2] + [(10240, 4, True, "silu")] for dt in (torch.bfloat16, torch.float16)]


def setup(gen: torch.Generator, dim: int, width: int, with_bias: bool, dtype: torch.dtype
          ) -> tuple[Tensor, Tensor, Tensor | None, Tensor]:
    """(conv_state pool, weight, bias, state indices: shuffled slots with two padded rows)."""
    state = torch.randn(POOL, dim, width - 1, generator=gen).to(DEVICE, dtype)
    weight = torch.randn(dim, width, generator=gen).to(DEVICE, dtype)
    bias = torch.randn(dim, generator=gen).to(DEVICE, dtype) if with_bias else None
    indices = torch.randperm(POOL, generator=gen)[:BATCH]
    indices[[1, 3]] = -1
    return state, weight, bias, indices.to(DEVICE)


def tokens(gen: torch.Generator, *size: int, dtype: torch.dtype) -> Tensor:
    """Random tokens as a strided view (the conv inputs are a slice of the input projection)."""
    return torch.randn(*size[:-1], size[-1] + 5, generator=gen).to(DEVICE, dtype)[..., 2 : size[-1] + 2]


def close(actual: Tensor, expected: Tensor) -> None:
    rtol, atol = TOL[actual.dtype]
    torch.testing.assert_close(actual.double().cpu(), expected.double().cpu(), rtol=rtol, atol=atol)


def as_ref(t: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    """The reference's copy of a kernel input: float64 for fp32 kernels, the same dtype otherwise."""
    if t is None:
        return None
    return t.double() if dtype == torch.float32 else t.clone()


@pytest.mark.parametrize(("dim", "width", "with_bias", "activation", "dtype"), CASES)
def test_update_matches_reference(dim: int, width: int, with_bias: bool, activation: str | None,
                                  dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(dim + width)
    state, weight, bias, indices = setup(gen, dim, width, with_bias, dtype)
    real = indices >= 0
    ref_state = as_ref(state, dtype)
    unused = [s for s in range(POOL) if s not in indices.tolist()]
    before = state[unused].clone()
    for _ in range(width + 1):  # past K - 1 steps every stored input is one of ours
        x = tokens(gen, BATCH, dim, dtype=dtype)
        y = causal_conv1d_update_triton(x, state, weight, bias, indices, activation)
        y_ref = causal_conv1d_update_ref(as_ref(x, dtype)[real], ref_state, as_ref(weight, dtype),
                                         as_ref(bias, dtype), indices[real], activation)
        assert y.dtype == dtype
        close(y[real], y_ref)
        assert not y[~real].any(), "padded rows output zeros"
        close(state, ref_state)
        assert torch.equal(state[unused], before), "slots outside the batch are untouched"


@pytest.mark.parametrize(("dim", "width", "with_bias", "activation", "dtype"), CASES)
@pytest.mark.parametrize("num_tokens", [1, 4])
def test_verify_matches_reference(dim: int, width: int, with_bias: bool, activation: str | None,
                                  dtype: torch.dtype, num_tokens: int) -> None:
    gen = torch.Generator().manual_seed(10 * dim + num_tokens)
    state, weight, bias, indices = setup(gen, dim, width, with_bias, dtype)
    real = indices >= 0
    before = state.clone()
    x = tokens(gen, BATCH, num_tokens, dim, dtype=dtype)
    y, window = causal_conv1d_verify_triton(x, state, weight, bias, indices, activation)
    y_ref, window_ref = causal_conv1d_verify_ref(as_ref(x, dtype)[real], as_ref(state, dtype), as_ref(weight, dtype),
                                                 as_ref(bias, dtype), indices[real], activation)
    assert y.dtype == window.dtype == dtype and window.shape == (BATCH, dim, width - 1 + num_tokens)
    close(y[real], y_ref)
    assert torch.equal(window[real].cpu(), window_ref.to(dtype).cpu()), "the window is the inputs as stored"
    assert not y[~real].any() and not window[~real].any(), "padded rows output zeros"
    assert torch.equal(state, before), "verify leaves the state alone"


@cuda_only
def test_conv_steps_replay_in_a_graph() -> None:
    """Decode and verify captured once, replayed with new tokens and a new slot order (padding moves)."""
    gen = torch.Generator().manual_seed(3)
    dim, width, dt = 512, 4, torch.bfloat16
    state, weight, bias, indices = setup(gen, dim, width, True, dt)
    x1, x4 = tokens(gen, BATCH, dim, dtype=dt), tokens(gen, BATCH, 4, dim, dtype=dt)

    def step() -> tuple[Tensor, ...]:
        return (causal_conv1d_update_triton(x1, state, weight, bias, indices),
                *causal_conv1d_verify_triton(x4, state, weight, bias, indices))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y1, y4, window = step()
    for _ in range(3):
        order = torch.randperm(POOL, generator=gen)[:BATCH]
        order[torch.randint(0, BATCH, (2,), generator=gen)] = -1
        indices.copy_(order)
        x1.copy_(torch.randn(BATCH, dim, generator=gen))
        x4.copy_(torch.randn(BATCH, 4, dim, generator=gen))
        ref_state = state.clone()
        real = indices >= 0
        graph.replay()
        y1_ref = causal_conv1d_update_ref(x1[real], ref_state, weight, bias, indices[real])
        y4_ref, window_ref = causal_conv1d_verify_ref(x4[real], ref_state, weight, bias, indices[real])
        close(y1[real], y1_ref)
        close(state, ref_state)
        # The verify ran after the update in the graph: it saw the updated state, as the references did.
        close(y4[real], y4_ref)
        assert torch.equal(window[real], window_ref)
        assert not y1[~real].any() and not y4[~real].any()
