"""gemv_triton (one-row linear) against the float64 product, and the Linear layer's dispatch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from replayserve.ops.gemv import gemv_ref
from replayserve.ops.gemv_triton import gemv_triton

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
# fp32 in the interpreter (its bf16 is broken); bf16 and fp16 on a GPU, with tolerances of their rounding.
DTYPES = [torch.float32] + ([torch.bfloat16, torch.float16] if CUDA else [])
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("n", "k", "bias"), [(10, 700, True), (37, 1500, False), (9, 5000, False),
                                              (5, 16400, True)])
def test_gemv_matches_float64(dtype: torch.dtype, n: int, k: int, bias: bool) -> None:
    """Each of `gemv_tiles`' three K ranges; N not a multiple of the row tile, K not of the column
    tile; a strided x."""
    gen = torch.Generator().manual_seed(n)
    wide = torch.randn(2, 2 * k, generator=gen, dtype=torch.float64)
    weight = (torch.randn(n, k, generator=gen, dtype=torch.float64) / k**0.5)
    b = torch.randn(n, generator=gen, dtype=torch.float64) if bias else None
    x64 = wide[:1, ::2]  # (1, K) with column stride 2
    x = x64.to(DEVICE, dtype)
    got = gemv_triton(x, weight.to(DEVICE, dtype), None if b is None else b.to(DEVICE, dtype))
    assert got.shape == (1, n) and got.dtype == dtype
    # The inputs rounded to dtype, then an exact product: what the kernel's fp32 sum approximates.
    rounded = gemv_ref(x.double().cpu(), weight.to(dtype).double(), None if b is None else b.to(dtype).double())
    scale = rounded.abs().max()
    assert (got.double().cpu() - rounded).abs().max() / scale < TOL[dtype]


def test_gemv_rejects_other_shapes() -> None:
    w = torch.zeros(4, 8, device=DEVICE)
    with pytest.raises(ValueError, match="must be"):
        gemv_triton(torch.zeros(2, 8, device=DEVICE), w)
    with pytest.raises(ValueError, match="do not match"):
        gemv_triton(torch.zeros(1, 7, device=DEVICE), w)


@pytest.mark.skipif(not CUDA, reason="the Linear layer takes the kernel only on CUDA")
def test_linear_one_row_takes_the_kernel_and_matches() -> None:
    from replayserve.layers.linear import Linear

    torch.manual_seed(0)
    layer = Linear(2688, 4608, bias=True).to("cuda", torch.bfloat16)
    x = torch.randn(3, 2688, device="cuda", dtype=torch.bfloat16)
    with torch.inference_mode():
        one = layer(x[:1])
        assert torch.equal(one, gemv_triton(x[:1], layer.weight, layer.bias))  # the kernel's result, bit for bit
        assert torch.allclose(one.float(), F.linear(x[:1], layer.weight, layer.bias).float(), rtol=2e-2, atol=2e-2)
        assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))  # more rows: nn.Linear's forward
    layer32 = Linear(64, 32).to("cuda")
    x32 = torch.randn(1, 64, device="cuda")
    with torch.inference_mode():
        assert torch.equal(layer32(x32), F.linear(x32, layer32.weight, layer32.bias))  # fp32 keeps cuBLAS
    y = layer(x[:1])  # autograd on: nn.Linear's forward, so the weights get gradients
    assert y.requires_grad and torch.equal(y, F.linear(x[:1], layer.weight, layer.bias))


def test_linear_on_cpu_is_nn_linear() -> None:
    from replayserve.layers.linear import Linear

    layer = Linear(16, 8)
    x = torch.randn(1, 16)
    y = layer(x)
    assert torch.equal(y, F.linear(x, layer.weight, layer.bias)) and y.requires_grad
    assert isinstance(layer, torch.nn.Linear) and set(layer.state_dict()) == {"weight", "bias"}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("n", "k", "conv_start", "dim", "width", "bias"), [
    (40, 700, 9, 22, 4, True),   # conv columns straddle row tiles on both ends
    (30, 5000, 0, 30, 3, False),  # every column convolved; K in the second tile range
    (16, 64, 12, 4, 2, True),     # the shortest conv: one stored input
])
def test_gemv_conv_equals_gemv_then_conv_update(dtype: torch.dtype, n: int, k: int, conv_start: int, dim: int,
                                                width: int, bias: bool) -> None:
    """The fused in_proj + conv step equals ``gemv_triton`` then ``causal_conv1d_update_ref`` on its
    stored output: the other columns bit for bit, the conv columns and the shifted state slot to
    fp32 rounding; other slots untouched. A negative slot leaves the pool alone and zeroes the conv
    columns."""
    from replayserve.ops.conv1d import causal_conv1d_update_ref
    from replayserve.ops.gemv_triton import gemv_conv_triton

    gen = torch.Generator().manual_seed(n + k)
    x = torch.randn(1, k, generator=gen).to(DEVICE, dtype)
    weight = (torch.randn(n, k, generator=gen) / k**0.5).to(DEVICE, dtype)
    conv_w = torch.randn(dim, width, generator=gen).to(DEVICE, dtype)
    conv_b = torch.randn(dim, generator=gen).to(DEVICE, dtype) if bias else None
    pool = torch.randn(5, dim, width - 1, generator=gen).to(DEVICE, dtype)
    slot = torch.tensor([3], device=DEVICE)

    plain = gemv_triton(x, weight)
    want_pool = pool.clone()
    want_conv = causal_conv1d_update_ref(plain[:, conv_start:conv_start + dim], want_pool, conv_w, conv_b, slot)
    got_pool = pool.clone()
    got = gemv_conv_triton(x, weight, None, conv_start, got_pool, conv_w, conv_b, slot)
    outside = torch.ones(n, dtype=torch.bool)
    outside[conv_start:conv_start + dim] = False
    assert torch.equal(got[:, outside.to(DEVICE)], plain[:, outside.to(DEVICE)])
    tol = TOL[dtype] if dtype != torch.float32 else 1e-6
    torch.testing.assert_close(got[:, conv_start:conv_start + dim].float(), want_conv.float(), atol=tol, rtol=tol)
    assert torch.equal(got_pool, want_pool)  # shifted inputs, no arithmetic
    assert not torch.equal(got_pool[3], pool[3])

    padded_pool = pool.clone()
    got = gemv_conv_triton(x, weight, None, conv_start, padded_pool, conv_w, conv_b, torch.tensor([-1], device=DEVICE))
    assert torch.equal(padded_pool, pool) and (got[:, conv_start:conv_start + dim] == 0).all()
    assert torch.equal(got[:, outside.to(DEVICE)], plain[:, outside.to(DEVICE)])


def test_gemv_conv_rejects_a_conv_past_the_output() -> None:
    from replayserve.ops.gemv_triton import gemv_conv_triton

    w = torch.zeros(8, 16, device=DEVICE)
    with pytest.raises(ValueError, match="conv_start"):
        gemv_conv_triton(torch.zeros(1, 16, device=DEVICE), w, None, 6, torch.zeros(2, 4, 3, device=DEVICE),
                         torch.zeros(4, 4, device=DEVICE), None, torch.zeros(1, dtype=torch.long, device=DEVICE))
