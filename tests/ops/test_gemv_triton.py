"""gemv_triton (one-row linear) against the float64 product, and the Linear layer's dispatch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from replayserve.ops.gemv_triton import gemv_ref, gemv_triton

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
# fp32 in the interpreter (its bf16 is broken); bf16 and fp16 on a GPU, with tolerances of their rounding.
DTYPES = [torch.float32] + ([torch.bfloat16, torch.float16] if CUDA else [])
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("n", "k", "bias"), [(10, 700, True), (37, 1500, False), (5, 16400, True)])
def test_gemv_matches_float64(dtype: torch.dtype, n: int, k: int, bias: bool) -> None:
    """N not a multiple of the 4-row tile, K not of the 512 (1024 past 16384) column tile, a strided x."""
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
